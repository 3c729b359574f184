"""``fedflat bench``: runs end to end on a tiny workload and writes valid JSON (speed is not asserted)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from agreement import bitwise

from fedflat.bench import BareLoop, WORKLOADS, bench, round_samples
from fedflat.bench.measure import busy_warning
from fedflat.bench.workloads import ROBERTA, prepare
from fedflat.cli import main
from fedflat.config import load_config
from fedflat.engine.simulation import Simulation


def test_bench_command_writes_json_with_machine_and_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--workload", "tiny", "--algos", "fedavg,fedsam", "--rounds", "1", "--warmup", "0",
                 "--threads", "1", "--quiet", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["machine"]["matmul_flops"] > 0 and report["machine"]["torch"]
    rows = {(r["algo"], r["engine"]): r for r in report["results"]}
    assert set(rows) == {("fedavg", "sequential"), ("fedavg", "vectorized"), ("bare-sgd", "bare"),
                         ("fedsam", "sequential"), ("fedsam", "vectorized"), ("bare-sam", "bare")}
    for (algo, engine), r in rows.items():
        s = r["seconds_per_round"]
        assert 0 < s["min"] <= s["median"] <= s["max"]
        assert r["rounds"] == 1 and r["samples_per_second"] > 0 and r["flops_per_round"] > 0
        assert r["backprops_per_step"] == (2 if "sam" in algo else 1)
        if engine != "bare":
            assert r["vs_bare"] > 0 and r["eval_seconds"] is not None
    # FLOPs scale with backprops: a SAM round does twice FedAvg's work on the same samples
    assert rows[("fedsam", "sequential")]["flops_per_round"] == pytest.approx(
        2 * rows[("fedavg", "sequential")]["flops_per_round"])
    printed = capsys.readouterr().out
    assert "s/round" in printed
    machine = report["machine"]
    assert machine["aten_level"] == torch.backends.cpu.get_cpu_capability()
    assert f"ATen dispatch {machine['aten_level']}" in printed


def test_the_bench_says_which_fused_kernels_run_and_at_which_aten_level(monkeypatch):
    """The machine's description names ATen's dispatch level (and the variable that forced it) and the native
    kernels where they are built, with whether ATen's expressions round FedWMSAM's alike; where they are not built it
    says the torch expressions run."""
    from fedflat.algorithms import fedwmsam
    from fedflat.bench.measure import FUSED_KERNELS, kernels, kernels_line
    from fedflat.core import vectors

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr(vectors, "_kernel_sources", [lambda name: print])
    monkeypatch.setattr(vectors, "_kernels", {})
    monkeypatch.setitem(fedwmsam._probed, "aten", False)
    line = kernels_line(kernels())
    assert "(ATEN_CPU_CAPABILITY=avx2)" in line and ", ".join(FUSED_KERNELS.values()) in line
    assert "ATen rounds FedWMSAM's point and the mix otherwise here" in line
    monkeypatch.setattr(vectors, "_kernel_sources", [lambda name: None])
    monkeypatch.setattr(vectors, "_kernels", {})
    monkeypatch.setitem(fedwmsam._probed, "aten", None)
    assert "none (not built: the torch expressions run)" in kernels_line(kernels())


def test_bench_counts_every_backward_pass_of_a_round(tmp_path):
    """tiny: 3 clients a round, 30 samples each, batch 10, 1 epoch: 9 local steps a round. FedAvg takes 9 backward
    passes, FedSAM 18, FedSCAM 18 + 4 a client (its B = 3 heterogeneity batches and its SAM pilot's second pass):
    30, which backprops_per_step (2, the local steps' alone) does not show."""
    out = tmp_path / "bench.json"
    main(["bench", "--workload", "tiny", "--algos", "fedavg,fedsam,fedscam", "--engines", "sequential",
          "--rounds", "1", "--warmup", "0", "--threads", "1", "--quiet", "--json", str(out)])
    rows = {r["algo"]: r for r in json.loads(out.read_text())["results"]}
    assert {a: rows[a]["backprops_per_round"] for a in rows} == {"fedavg": 9, "fedsam": 18, "fedscam": 30}
    assert rows["fedscam"]["backprops_per_step"] == 2 and rows["fedscam"]["backprops_vs_fedavg"] == 30 / 9
    assert rows["fedscam"]["cost_per_backprop"] == pytest.approx(rows["fedscam"]["vs_fedavg"] * 9 / 30)


def test_round_samples_counts_every_local_batch():
    """tiny: 180 samples over 6 iid clients (30 each), 3 per round, 1 epoch: 90 samples per round."""
    sim = Simulation(load_config(None, [], base=WORKLOADS["tiny"].tree))
    assert round_samples(sim, 0) == 90


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_bare_loop_does_the_same_fedavg_round(precision):
    """Without clipping, the bare loop (torch.optim.SGD, coupled weight decay) and fedflat compute the
    same FedAvg round on the same batches, in the run's precision (bf16: both under autocast).

    On CUDA fedflat runs its sequential engine here, whose products are the bare loop's (the same shapes, so the
    same cuBLAS kernels): ``engine: auto`` would be the vectorized engine, whose batched bf16 products sum each
    output in another order before rounding it to bfloat16, and one bf16 rounding (2^-8 relative) of a product's
    output, compounded over the round's steps, is far above the float32 bound compared here."""
    cfg = load_config(None, list(bitwise("train.clip=null", f"precision={precision}")), base=WORKLOADS["tiny"].tree)
    sim = Simulation(cfg)
    bare = BareLoop(Simulation(cfg), backprops=1)
    sim.run_round(0)
    bare.run_round(0)
    assert (sim.server.w - bare.w).abs().max() < 1e-5
    if precision == "bf16":
        float32 = Simulation(load_config(None, ["train.clip=null"], base=WORKLOADS["tiny"].tree))
        float32.run_round(0)
        assert (float32.server.w - bare.w).abs().max() > 1e-4


def test_plain_loop_ignores_precision_and_memory_order(tmp_path):
    """The plain loop of a ``precision=bf16 channels_last=true`` bench is the float32, NCHW loop (the same round as
    the bare loop of a float32 bench, bit for bit), which the options' speed-up is measured against (``vs_plain``);
    the bare loop follows the options."""
    overrides = list(bitwise("train.clip=null", "model=cnn", "model.padding=2", "data.options.shape=[1,8,8]"))
    float32 = load_config(None, overrides, base=WORKLOADS["tiny"].tree)
    options = load_config(None, [*overrides, "precision=bf16", "channels_last=true"], base=WORKLOADS["tiny"].tree)
    loops = [BareLoop(Simulation(float32), 1), BareLoop(Simulation(options), 1, plain=True),
             BareLoop(Simulation(options), 1)]
    for loop in loops:
        loop.run_round(0)
    assert torch.equal(loops[0].w, loops[1].w) and not torch.equal(loops[0].w, loops[2].w)
    out = tmp_path / "bench.json"
    main(["bench", "--workload", "tiny", "--algos", "fedavg", "--engines", "sequential,bare,plain", "--rounds", "1",
          "--warmup", "0", "--threads", "1", "--quiet", "--json", str(out), "precision=bf16"])
    rows = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["plain"]["algo"] == "plain-sgd" and rows["plain"]["precision"] == "float32"
    assert rows["bare"]["precision"] == "bf16" and rows["sequential"]["vs_plain"] > 0 < rows["sequential"]["vs_bare"]


def test_unknown_workload_or_engine_is_an_error():
    with pytest.raises(ValueError, match="unknown workload"):
        bench(["W9"], ["fedavg"], ["sequential"], 1)
    with pytest.raises(ValueError, match="unknown engine"):
        bench(["tiny"], ["fedavg"], ["turbo"], 1)


def test_bench_reports_progress_per_round_and_warns_on_a_busy_machine(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))  # other jobs on a 2-core machine
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    bench(["tiny"], ["fedavg"], ["sequential"], rounds=2, warmup=1, threads=1, progress=lines.append)
    assert lines[0].startswith("warning: the machine is busy (load average 7.5")
    rounds = [line for line in lines if "of every contestant done" in line]
    assert [r.split()[1] for r in rounds] == ["1/3", "2/3", "3/3"] and "(warm-up)" in rounds[0]
    assert busy_warning([0.3, 0.2, 0.1], 2) is None


def test_bench_refuses_zero_rounds_or_threads(capsys):
    for flag in ("--rounds", "--threads"):
        with pytest.raises(SystemExit):
            main(["bench", flag, "0"])
        assert "must be at least 1" in capsys.readouterr().err


# -- LoRA workloads: the bare loop of plain PyTorch + peft --------------------------------------------------------
VIT_LORA = ("model=vit", "model.patch=2", "model.dim=16", "model.depth=1", "model.heads=2", "adapter.r=2",
            "adapter.dropout=0")
#: a RoBERTa of W5's kind at test size, without dropout (so that fedflat's keyed masks and the bare loop's agree)
TINY_ROBERTA = {**ROBERTA, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "intermediate_size": 32, "vocab_size": 50, "max_position_embeddings": 12,
                "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def tiny_roberta(folder) -> tuple[str, ...]:
    """Overrides of the tiny problem that train W5's kind of model (a Hugging Face RoBERTa from a config.json the
    bench writes, LoRA on query/value) on 8 token ids a sample."""
    workload = replace(WORKLOADS["W5"], hf_config=TINY_ROBERTA)
    return ("model=hf", "model.random_weights=true", *prepare(workload, folder), "data.options.shape=[8]",
            "data.options.tokens=50", "adapter.r=2", "adapter.target_modules=[query,value]", "adapter.dropout=0")


@pytest.mark.parametrize("model", ["vit", "roberta"])
def test_bare_peft_loop_does_the_same_lora_round(model, tmp_path):
    """The bare loop under an adapter section is plain PyTorch + peft (get_peft_model with the same LoraConfig, SGD
    over the adapters and the head): on the same base it computes fedflat's FedAvg round. The frozen base is the
    one fedflat built (drawn from the run's seed) and stays as it was; only the trained tensors are copied in.

    Tolerance: both compute the same products in float32; they differ by the aggregation's order (fedflat's
    sample-weighted sum against the loop's mean) and autograd's accumulation order, a few ulps of entries O(1)."""
    overrides = VIT_LORA if model == "vit" else tiny_roberta(tmp_path / "roberta")
    cfg = load_config(None, list(bitwise("train.clip=null", *overrides)), base=WORKLOADS["tiny"].tree)
    sim, bare = Simulation(cfg), BareLoop(Simulation(cfg), backprops=1)
    trained = [n for n, p in bare.module.named_parameters() if p.requires_grad]
    assert trained == list(sim.model.layout.names) and sum(p.numel() for p in bare.params) == sim.num_parameters
    assert any(".lora_A." in n for n in trained) and type(bare.module).__module__.startswith(
        "peft" if model == "vit" else "fedflat")  # (the Hugging Face wrapper holds the PeftModel)
    theirs = {n: p for n, p in sim.model.module.named_parameters() if not p.requires_grad}
    base = {n: p.detach().clone() for n, p in bare.module.named_parameters() if not p.requires_grad}
    assert base.keys() == theirs.keys() and all(torch.equal(base[n], theirs[n]) for n in base)
    w0 = sim.server.w.clone()
    sim.run_round(0)
    bare.run_round(0)
    assert (sim.server.w - w0).abs().max() > 1e-3  # the round moved the adapters
    assert (sim.server.w - bare.w).abs().max() < 1e-5
    assert all(torch.equal(p, base[n]) for n, p in bare.module.named_parameters() if not p.requires_grad)


def test_lora_workloads_race_fedflat_against_the_bare_peft_loop(tmp_path, monkeypatch):
    """A LoRA workload (W5's model at test size) runs in the bench beside its bare loops, with CPU-time ratios; the
    model folder the bench wrote is gone after it."""
    tree = load_config(None, list(tiny_roberta(tmp_path / "unused")), base=WORKLOADS["tiny"].tree).model_dump()
    tree["model"].pop("path")
    workload = replace(WORKLOADS["W5"], name="tiny-lora", tree=tree, hf_config=TINY_ROBERTA)
    monkeypatch.setitem(WORKLOADS, "tiny-lora", workload)
    folders: list[str] = []
    import fedflat.bench.measure as measure
    real = measure.prepare
    monkeypatch.setattr(measure, "prepare", lambda w, folder: folders.append(folder) or real(w, folder))
    report = bench(["tiny-lora"], ["fedavg", "fedsam"], ["sequential", "vectorized", "bare"], rounds=1, warmup=0,
                   threads=1, progress=lambda msg: None)
    rows = {(r["algo"], r["engine"]): r for r in report["results"]}
    for algo in ("fedavg", "fedsam"):
        for engine in ("sequential", "vectorized"):  # (ids alone, no attention mask: RoBERTa's forward runs under vmap)
            r = rows[(algo, engine)]
            assert r["vs_bare"] > 0 and r["vs_bare_cpu"] > 0 and r["backprops_per_step"] == (2 if algo == "fedsam" else 1)
    assert ("bare-sgd", "bare") in rows and ("bare-sam", "bare") in rows
    assert folders and not any(os.path.exists(f) for f in folders)


def test_the_lora_workloads_configs():
    """W5 writes a RoBERTa config.json transformers reads with its sizes; W5 and W6 adapt attention with rank 8."""
    from transformers import AutoConfig

    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        overrides = prepare(WORKLOADS["W5"], folder)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        assert overrides == [f"model.path={folder}"]
        assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
            "roberta", 256, 4, 5000)
    assert prepare(WORKLOADS["W6"], "/nonexistent") == []  # (fedflat's own ViT: nothing to write)
    w5, w6 = (load_config(None, list(WORKLOADS[n].cpu_overrides) + (["model.path=x"] if n == "W5" else []),
                          base=WORKLOADS[n].tree) for n in ("W5", "W6"))
    assert w5.adapter.r == w6.adapter.r == 8 and w5.adapter.target_modules == ["query", "value"]
    assert w6.model == {"name": "vit", "variant": "base16"} and w6.data.options["shape"] == [3, 224, 224]
