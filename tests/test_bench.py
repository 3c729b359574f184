"""``fedflat bench``: runs end to end on a tiny workload and writes valid JSON (speed is not asserted)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from agreement import bitwise

from fedflat.bench import BareLoop, WORKLOADS, bench, round_samples
from fedflat.bench.measure import busy_warning
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
    assert "s/round" in capsys.readouterr().out


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
