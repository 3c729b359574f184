"""Low-rank adapters (peft's LoRA and AdaLoRA) as the federated parameters: what travels, what stays frozen, one path
equal to another, the federated-LoRA baselines, peft's own format, and the refusals.

The tiny problem's model here is fedflat's ViT at 4x4 inputs (patch 2: four tokens, width 16, one block), LoRA of
rank 2 on ``attn.qkv`` and ``attn.proj`` (FedSWA's targets) and the head trained whole.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import fedflat
from fedflat.algorithms import RECIPES
from fedflat.core import ConfigError
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.models import assemble, build_model, frozen_hash
from fedflat.config import AdapterConfig
from fedflat.models.lora import check_targets, lora_alpha

peft = pytest.importorskip("peft")

VIT = ("model=vit", "model.patch=2", "model.dim=16", "model.depth=1", "model.heads=2")
LORA = (*VIT, "adapter.r=2")
UNEQUAL = ("rounds=2", "train.batch_size=7", "train.local_epochs=2")


def run(tiny, *overrides, **options):
    return fedflat.run(tiny(*LORA, *overrides), save=False, progress=False, **options)


def frozen(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}


def test_only_the_adapters_and_the_head_are_federated(tiny):
    """w holds every lora_A, lora_B and the head's trained copy, nothing of the base; an upload is w's size."""
    sim = Simulation(tiny(*LORA))
    names = sim.model.layout.names
    assert names and all(".lora_A." in n or ".lora_B." in n or ".modules_to_save." in n for n in names)
    assert sum(".lora_A." in n for n in names) == sum(".lora_B." in n for n in names) == 2  # qkv and proj
    # the adapters: r x 16 (A) and 48 x r, 16 x r (B) at r = 2, and the head 3 x 16 + 3
    assert sim.num_parameters == 2 * 16 * 2 + (48 + 16) * 2 + 3 * 16 + 3
    before = frozen(sim.model.module)
    assert sum(t.numel() for t in before.values()) > 10 * sim.num_parameters  # the base (and the head's original)
    sim.run_round(0)
    assert all(torch.equal(before[n], p) for n, p in sim.model.module.named_parameters() if not p.requires_grad)
    history = run(tiny, "rounds=1")
    line = history.metrics[-1]
    assert line["up_vectors"] == 1  # one adapter-sized vector a client (float32) and the loss's scalar
    assert 4 * sim.num_parameters <= line["up_bytes"] <= 4 * sim.num_parameters + 8
    assert history.summary["base_hash"] == frozen_hash(sim.model.module)
    assert set(history.state_dict) == set(names)  # the federated state: the base is the module's own


def test_the_adapter_section_equals_peft_in_a_model_fn(tiny):
    """adapter.r=2 builds exactly what a user's model_fn that calls peft itself builds: the same run, bit for bit."""
    def model_fn():
        base = build_model("vit", (1, 4, 4), 3, patch=2, dim=16, depth=1, heads=2)
        config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.05, target_modules=["attn.qkv", "attn.proj"],
                                 modules_to_save=["head"])
        return peft.get_peft_model(base, config)

    by_config = run(tiny, *UNEQUAL, "algo=fedsam")
    by_hand = fedflat.run(tiny(*VIT, *UNEQUAL, "algo=fedsam"), model_fn=model_fn, save=False, progress=False)
    assert torch.equal(by_config.final_parameters, by_hand.final_parameters)


@pytest.mark.parametrize("engine", ["vectorized", "streams"])
def test_engines_agree_on_adapters(tiny, engine):
    """Dropout on the adapters' input is drawn from each client's stream on every engine: the streams engine is the
    sequential run bit for bit, the vectorized one to float32 rounding (batched products)."""
    sequential = run(tiny, *UNEQUAL, "algo=fedsam", "engine=sequential")
    other = run(tiny, *UNEQUAL, "algo=fedsam", f"engine={engine}")
    if engine == "streams":
        assert torch.equal(other.final_parameters, sequential.final_parameters)
    else:
        torch.testing.assert_close(other.final_parameters, sequential.final_parameters, rtol=1e-4, atol=1e-5)


def test_thread_workers_share_the_frozen_base_and_give_the_local_run(tiny):
    local = run(tiny, *UNEQUAL, "algo=fedlesam")
    threaded = run(tiny, *UNEQUAL, "algo=fedlesam", "executor.name=threads", "executor.workers=2")
    assert torch.equal(threaded.final_parameters, local.final_parameters)
    sim = Simulation(tiny(*LORA, "executor.name=threads", "executor.workers=2"))
    driver, worker = (r.model.module for r in sim.executor.runtimes)
    theirs = dict(worker.named_parameters())
    for name, p in driver.named_parameters():
        assert theirs[name].data_ptr() == p.data_ptr()  # one base in the process, not one a thread


def test_a_worker_with_another_base_is_refused_naming_both_digests(tiny):
    from dataclasses import replace

    from fedflat.engine.runtime import build_client_runtime

    sim = Simulation(tiny(*LORA))
    spec = replace(sim.worker_spec(), base_hash="0" * 32)
    with pytest.raises(ConfigError, match=f"digest {sim.report.base_hash}.*digest {'0' * 32}"):
        build_client_runtime(spec, sim.batches, sim.device)
    build_client_runtime(sim.worker_spec(), sim.batches, sim.device)  # its own digest: accepted


def test_the_saved_adapter_loads_with_peft_and_gives_the_runs_model(tiny, tmp_path):
    """run/adapter/ is peft's format: PeftModel.from_pretrained on the base gives the run's final logits, and the
    merged model (W0 + (alpha/r) B A) the same up to float32 rounding of the merge."""
    history = fedflat.run(tiny(*LORA, "algo=fedsam", "rounds=2"), out=str(tmp_path), progress=False)
    folder = history.run_dir / "adapter"
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 2
    sim = Simulation(tiny(*LORA, "algo=fedsam"))
    x = sim.dataset.x_test[:20]
    expected = sim.model(history.final_parameters, x)

    base = assemble(lambda: build_model("vit", (1, 4, 4), 3, patch=2, dim=16, depth=1, heads=2), seed=0)
    loaded = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
        merged = loaded.merge_and_unload()(x)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)


def test_a_run_starts_from_a_peft_adapter(tiny, tmp_path):
    first = fedflat.run(tiny(*LORA, "rounds=2"), out=str(tmp_path), progress=False)
    folder = first.run_dir / "adapter"
    sim = Simulation(tiny(*VIT, f"adapter.init={folder}"))
    assert torch.equal(sim.server.w, first.final_parameters)
    with pytest.raises(ConfigError, match="not a peft adapter folder"):
        Simulation(tiny(*VIT, f"adapter.init={tmp_path}"))


def test_ffa_lora_trains_b_alone_and_keeps_the_seeded_a(tiny):
    """FFA-LoRA: no lora_A in w; every A after training is A as a fresh build draws it from the seed."""
    history = run(tiny, "algo=ffa-lora", "rounds=2")
    sim = Simulation(tiny(*LORA, "algo=ffa-lora"))
    assert not any(".lora_A." in n for n in sim.model.layout.names)
    assert any(".lora_B." in n for n in sim.model.layout.names)
    fresh = Simulation(tiny(*LORA, "adapter.freeze_a=true", "seed=0"))
    a = {n: p for n, p in fresh.model.module.named_parameters() if ".lora_A." in n}
    assert a and all(torch.equal(p, dict(sim.model.module.named_parameters())[n]) for n, p in a.items())
    assert history.summary["algorithm"] == "ffa-lora"
    with pytest.raises(ConfigError, match="adapter.freeze_a"):
        Simulation(tiny(*LORA, "algo=ffa-lora", "adapter.freeze_a=false"))
    with pytest.raises(ConfigError, match="add an adapter section"):
        Simulation(tiny(*VIT, "algo=ffa-lora"))


def test_fedsa_lora_keeps_each_clients_b_and_aggregates_a(tiny):
    sim = Simulation(tiny(*LORA, "algo=fedsa-lora", "train.lr=0.5"))
    layout = sim.model.layout
    b_mask = torch.zeros(layout.size, dtype=torch.bool)
    for name, offset, numel in zip(layout.names, layout.offsets, layout.numels):
        b_mask[offset:offset + numel] = ".lora_B." in name
    w0 = sim.server.w.clone()
    for t in range(2):
        sim.run_round(t)
    assert torch.equal(sim.server.w[b_mask], w0[b_mask])  # B never reaches the server
    assert not torch.equal(sim.server.w[~b_mask], w0[~b_mask])  # A and the head are aggregated
    kept = sim.server.store.state_dict()["fedper.w_i"]
    assert kept and all(row[b_mask].abs().sum() > 0 for row in kept.values())  # each client's own B


def test_adalora_runs_in_its_svd_form(tiny):
    sim = Simulation(tiny(*VIT, "adapter.method=adalora", "adapter.r=2"))
    names = sim.model.layout.names
    assert any(".lora_E." in n for n in names)
    e = [s for n, s in zip(names, sim.model.layout.shapes) if ".lora_E." in n]
    assert all(s[0] == 4 for s in e)  # init_r = 2r, as FedSWA's code
    w0 = sim.server.w.clone()
    sim.run_round(0)
    assert not torch.equal(sim.server.w, w0)


def test_target_modules_and_ranks_are_checked_with_the_models_layers():
    model = build_model("vit", (1, 4, 4), 3, patch=2, dim=16, depth=1, heads=2)
    with pytest.raises(ConfigError, match=r"'query' matches no .*blocks\.\*\.attn\.qkv"):
        check_targets(model, ["query"], 2)
    with pytest.raises(ConfigError, match=r"adapter.r=17 is larger than layer 'blocks.0.attn.proj' allows"):
        check_targets(model, ["attn.proj"], 17)
    check_targets(model, ["attn.qkv", "attn.proj"], 16)


def test_a_model_without_default_targets_names_its_layers(tiny):
    with pytest.raises(ConfigError, match=r"adapter.target_modules: fedflat knows no default for MLP.*its layers: body\.\*, head"):
        Simulation(tiny("adapter.r=2"))
    sim = Simulation(tiny("adapter.r=2", "adapter.target_modules=[body.0]", "adapter.modules_to_save=[]"))
    assert all(".lora_" in n for n in sim.model.layout.names)


def test_a_fully_frozen_model_is_refused(tiny):
    def model_fn():
        module = build_model("mlp", (1, 4, 4), 3, hidden=[8])
        return module.requires_grad_(False)

    with pytest.raises(ConfigError, match="every parameter is frozen"):
        Simulation(tiny(), UserInputs(model_fn=model_fn))


# What a recipe needs that LoRA's model lacks: FedBN's BatchNorm; MOON's contrastive term and FedMAN's activation
# penalty a model without dropout (adapter.dropout=0 gives one, and then they run)
NEEDS = {"fedbn": "BatchNorm", "moon": "without buffers, batch statistics or dropout",
         "man": "activation penalty.*adapter.dropout=0"}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_method_trains_the_adapters_or_says_why_not(tiny, name):
    """Every recipe perturbs, corrects and aggregates the adapters (a round moves w, finite), or is refused with a
    line naming what the adapters' model lacks, and then runs where the option that supplies it is set."""
    overrides = (*LORA, f"algo={name}", "rounds=3")
    recipe = RECIPES[name]
    need = NEEDS.get(recipe.personalization) or NEEDS.get(recipe.correction) or NEEDS.get(recipe.filter)
    if need is not None:
        with pytest.raises(ConfigError, match=need):
            Simulation(tiny(*overrides)).run_round(0)
        if recipe.personalization == "fedbn":
            return
        overrides = (*overrides, "adapter.dropout=0")
    sim = Simulation(tiny(*overrides))
    w0 = sim.server.w.clone()
    sim.run_round(0)
    assert torch.isfinite(sim.server.w).all() and not torch.equal(sim.server.w, w0)


def test_sdpa_without_dropout_is_not_a_random_operation():
    from fedflat.engine.modes import RandomOps

    q = torch.randn(1, 2, 4, 8)
    with RandomOps() as ops:
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
    assert ops.seen == []
    with RandomOps() as ops:
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert ops.seen


def test_the_adapter_section_is_validated():
    with pytest.raises(ValueError, match="freeze_a is FFA-LoRA's"):
        AdapterConfig(method="adalora", freeze_a=True)
    assert lora_alpha(AdapterConfig(r=8)) == 16  # FedSWA's and FedNSAM's alpha = 2r


# -- a Hugging Face folder: a tiny RoBERTa (random weights, its own tokenizer) on a GLUE task read from local files --
@pytest.fixture(scope="module")
def roberta(tmp_path_factory):
    """``(model folder, data root)``: tests/hf_folders.py's tiny RoBERTa and an SST-2 in the hub's parquet layout."""
    from hf_folders import tiny_glue, tiny_text_model

    root = tmp_path_factory.mktemp("hf")
    model = tiny_text_model(root / "roberta", "roberta", num_labels=2)
    tiny_glue(root / "data" / "glue", "sst2", "parquet", train=96, validation=48)
    return model, root / "data"


def glue_run(model, data, *extra) -> list[str]:
    return ["model=hf", f"model.path={model}", "data.name=glue", "data.options.task=sst2",
            "data.options.max_length=24", f"data.root={data}", "data.num_clients=4", "sampling.clients_per_round=2",
            "data.partition.min_size=5", "train.local_epochs=1", "train.batch_size=16", "rounds=2", "threads=1",
            "adapter.r=4", *extra]


def test_a_huggingface_classifier_reads_fedflats_token_tensor(roberta):
    """The wrapper's forward on ``x [B, K, L]`` is the transformers model's on ``input_ids=x[:,0],
    attention_mask=x[:,1]``; its features are what the classifier head reads."""
    from transformers import AutoModelForSequenceClassification

    from fedflat.models.hub import Classifier

    folder, _ = roberta
    module = build_model("hf", (2, 8), 2, path=str(folder)).eval()
    assert isinstance(module, Classifier) and module.input_dtype == torch.long
    reference = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2,
                                                                   attn_implementation="eager").eval()
    ids = torch.randint(3, 40, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    x = torch.stack([ids, mask], 1)
    with torch.no_grad():
        assert torch.equal(module(x), reference(input_ids=ids, attention_mask=mask).logits)
        assert module.features(x).shape == (3, 32)
    with pytest.raises(ConfigError, match="config.json not found"):
        build_model("hf", (2, 8), 2, path=str(folder / "missing"))


def test_lora_on_roberta_from_the_command_line_saves_an_adapter_peft_loads(roberta, tmp_path, capsys):
    """``fedflat run model=hf ... adapter.r=4 algo=fedsam`` on the GLUE folder (the tokenizer: the model's own, by
    default); the run's adapter loads onto AutoModelForSequenceClassification with PeftModel.from_pretrained and
    gives the run's final logits; `fedflat evaluate` reproduces its accuracy, merged too."""
    from transformers import AutoModelForSequenceClassification

    from fedflat.cli import main
    from fedflat.config import load_config
    from fedflat.engine.checkpoint import run_config

    folder, data = roberta
    assert main(["run", *glue_run(folder, data, "algo=fedsam"), "--out", str(tmp_path), "--no-progress"]) == 0
    run_dir = next(tmp_path.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["adapter"]["r"] == 4 and summary["base_hash"]
    assert load_config(None, glue_run(folder, data)).data.options["tokenizer"] == str(folder)

    sim = Simulation(run_config(run_dir))
    w, _ = sim.model.vectors(torch.load(run_dir / "model.pt", weights_only=True))
    x = sim.dataset.x_test[:8]
    base = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2, attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x[:, 0], attention_mask=x[:, 1]).logits, sim.model(w, x),
                                   rtol=0, atol=0)
    capsys.readouterr()
    for extra in ([], ["--merged"]):
        assert main(["evaluate", str(run_dir), *extra]) == 0
        assert "(reproduced)" in capsys.readouterr().out


@pytest.mark.slow  # two Hugging Face runs in a sweep: ~40 s on 2 cores
def test_a_sweep_compares_methods_on_lora_adapters(roberta, tmp_path):
    import yaml

    from fedflat.experiments.sweep import load_sweep, run_sweep

    folder, data = roberta
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"base": "quickstart", "overrides": glue_run(folder, data),
                                    "grid": {"algo": ["fedavg", "fedsam"]}, "out": str(tmp_path / "out")}))
    result = run_sweep(load_sweep(spec), progress=False)
    cells = [c for c in result.cells if c.get("status") == "completed"]
    assert len(cells) == 2 and not result.failed
    assert all((result.folder / c["name"] / "adapter" / "adapter_model.safetensors").is_file() for c in cells)


@pytest.mark.parametrize("stage", [
    ("privacy.mode=central", "privacy.noise_multiplier=0.5", "privacy.clip=0.3"),
    ("privacy.mode=local", "privacy.noise_multiplier=0.1", "privacy.clip=0.3"),
    ("privacy.level=instance", "privacy.noise_multiplier=0.5", "privacy.clip=0.3", "adapter.dropout=0"),
    ("robust.name=median", "attack.name=sign_flip", "sampling.clients_per_round=5"),
    ("compression.name=topk", "compression.ratio=0.3"),
])
def test_the_upload_path_acts_on_the_adapters(tiny, stage):
    """DP (client-level, local, DP-SGD), robust rules under attack and compression run on the adapters: the run
    completes with finite adapters, and a DP run spends a finite epsilon."""
    history = run(tiny, "algo=fedsam", "rounds=2", *stage)
    assert history.summary["status"] == "completed" and torch.isfinite(history.final_parameters).all()
    if stage[0].startswith("privacy"):
        assert 0 < history.summary["epsilon"] < float("inf")


def test_dp_sgd_refuses_the_adapters_dropout_naming_the_option(tiny):
    with pytest.raises(ConfigError, match=r"adapter.dropout=0"):
        Simulation(tiny(*LORA, "privacy.level=instance", "privacy.noise_multiplier=0.5", "privacy.clip=0.3"))


def test_diagnostics_measure_the_adapter_subspace(tiny):
    """Sharpness and the other diagnostics run on w, the adapters: their global SAM sharpness is finite."""
    history = run(tiny, "rounds=2", "diagnostics.every=1", "diagnostics.kinds=[sharpness,drift]")
    sharp = [m for m in history.metrics if "sharpness" in m or any(k.startswith("sharp") for k in m)]
    assert sharp, history.metrics[-1].keys()


def test_a_flower_node_with_another_base_is_refused_naming_both_digests(tiny, tmp_path):
    """The server's train message carries its base's digest; a node whose base differs refuses the task naming both,
    and one with the same base trains it. A node's own path to the base: node config ``model-path``."""
    pytest.importorskip("flwr")
    from fedflat.flower.apps import with_model_path
    from fedflat.flower.node import Node
    from fedflat.flower.protocol import task_content

    cfg = tiny(*LORA)
    sim = Simulation(cfg)
    node = Node(cfg, 0, 1, tmp_path / "state", sim)
    opened = sim.server.begin_round(0)
    rounds = [-1] * len(opened.task.ids)
    with pytest.raises(ConfigError, match=f"digest {sim.report.base_hash}.*digest {'f' * 32}"):
        node.fit(task_content(opened.broadcast, opened.task, rounds, "f" * 32))
    _, result = node.fit(task_content(opened.broadcast, opened.task, rounds, sim.report.base_hash))
    assert result.upload["model"].shape == (len(opened.task.ids), sim.num_parameters)
    moved = with_model_path(tiny(*LORA, "model.pretrained=/somewhere/vit.pt"), str(tmp_path / "vit.pt"))
    assert moved.model["pretrained"] == str(tmp_path / "vit.pt")
    assert with_model_path(tiny("model=hf", "model.path=/a"), "/b").model["path"] == "/b"


@pytest.mark.slow  # Ray workers: ~30 s
def test_ray_workers_load_their_own_base_and_give_the_local_run(tiny):
    pytest.importorskip("ray")
    local = run(tiny, *UNEQUAL, "algo=fedsam")
    remote = run(tiny, *UNEQUAL, "algo=fedsam", "executor.name=ray", "executor.workers=2")
    assert torch.equal(remote.final_parameters, local.final_parameters)


def test_a_lora_run_resumes_to_the_uninterrupted_run(tiny, tmp_path):
    """Killed after round 3 (last checkpoint: round 2), resumed: the adapters and the kept client state (SCAFFOLD's
    c_i, adapter-sized) equal the uninterrupted run's; the base is read again from the config."""
    from test_resume import _interrupted

    from fedflat.experiments.resume import resume

    cfg = tiny(*LORA, "algo=scaffold", "rounds=4", "checkpoint_every=2")
    full = fedflat.run(cfg, run_dir=tmp_path / "full", progress=False)
    folder = _interrupted(cfg, tmp_path, stop_after=3)
    resumed = resume(folder, progress=False)
    assert resumed.summary["status"] == "completed"
    assert torch.equal(resumed.final_parameters, full.final_parameters)
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()


def test_secagg_sums_the_adapters_as_the_plain_round_within_the_quantization_bound(tmp_path, monkeypatch):
    """Flower's SecAgg+ masks and sums adapter-sized vectors: the secure round's adapters equal the plain round's
    within test_secagg.py's quantization bound, and the frozen base is the same on the server and every node."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_secagg import N, SECURE, clients_per_node, plain_round, quantization_bound, secure_round, small

    for name, value in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):  # (test_secagg.py's fixture)
        monkeypatch.setattr(TaskIdentity, name, value)

    cfg = small("fedsam", *SECURE, *LORA, "data.options.shape=[1,4,4]")
    secure, _ = secure_round(cfg, tmp_path)
    plain = plain_round(cfg)
    assert secure.server.w.numel() == plain.server.w.numel() == secure.num_parameters
    bound = quantization_bound(3, clients_per_node(3, list(range(N))), plain.server.w)
    assert (secure.server.w - plain.server.w).abs().max().item() <= bound
    assert (plain.server.w - plain.w_before).abs().max() > 5 * bound
