"""The LoRA evidence's shipped configs (docs/lora_evidence.md): the pretraining and the sweep validate, fit together
(the sweep fine-tunes what the pretraining writes, on classes it never saw), and a cell of the sweep runs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fedflat
from fedflat.experiments.sweep import load_sweep

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
# LoRA r = 8 on the ViT of width 48, depth 3: A (r x 48) and B (out x r) on attn.qkv (48 -> 144) and attn.proj
# (48 -> 48) of each block, and the new head (6 x 48 + 6) trained whole
LORA_PARAMETERS = 3 * 8 * (48 + 144 + 48 + 48) + 6 * 48 + 6


def test_the_shipped_configs_validate_and_fit_together():
    pretrain, sweep = load_sweep("lora_fmnist_pretrain"), load_sweep("lora_fmnist_sweep")
    (base,) = pretrain.cells()
    cells = sweep.cells()
    assert base.error is None and [c.name for c in cells if c.error] == []
    assert len(cells) == 23 * 3
    checkpoint = pretrain.out / base.name / "model.pt"
    seen, new = set(base.config.data.options["classes"]), set(cells[0].config.data.options["classes"])
    assert not seen & new and seen | new == set(range(10))  # every class once: pretrained on some, tuned on the rest
    for cell in cells:
        cfg, kind = cell.config, cell.name.split("__")[0]
        expected = None if kind.startswith("scratch") else str(checkpoint)
        assert cfg.model["pretrained"] == expected, cell.name
        assert {k: cfg.model[k] for k in ("patch", "dim", "depth", "heads")} == \
            {k: base.config.model[k] for k in ("patch", "dim", "depth", "heads")}
        assert (cfg.adapter is None) == ("full" in kind or "scratch" in kind), cell.name
        assert (cfg.privacy is not None) == ("eps" in kind), cell.name


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_FMNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_a_cell_fine_tunes_the_pretrained_base_with_adapters(tmp_path, monkeypatch):
    """The pretraining (one round of two steps) writes the checkpoint the sweep names; a LoRA FedSAM cell (one
    round, two clients, two steps) then trains the adapters and the new head alone, on the checkpoint's frozen
    weights: an upload is LoRA's size, and the frozen base equals the checkpoint, tensor for tensor."""
    from fedflat.cli import main

    monkeypatch.chdir(tmp_path)
    short = ["rounds=1", "train.local_steps=2"]
    assert main(["sweep", "lora_fmnist_pretrain", "--no-progress", *short]) == 0
    checkpoint = torch.load(tmp_path / "runs/sweeps/lora_fmnist_pretrain/seed0/model.pt", weights_only=True)
    (cell,) = [c for c in load_sweep("lora_fmnist_sweep", extra_overrides=[*short, "sampling.clients_per_round=2"])
               .cells() if c.name == "lora-fedsam__seed0"]
    history = fedflat.run(cell.config, save=False, progress=False)
    assert history.summary["status"] == "completed" and history.summary["parameters"] == LORA_PARAMETERS
    assert 4 * LORA_PARAMETERS <= history.metrics[-1]["up_bytes"] <= 4 * LORA_PARAMETERS + 8
    from fedflat.engine.simulation import Simulation

    module = Simulation(cell.config).model.module
    frozen = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
              for n, p in module.named_parameters() if not p.requires_grad}
    shared = [n for n in checkpoint if n in frozen]
    assert "blocks.0.attn.qkv.weight" in shared and len(shared) == len(checkpoint) - 2  # all but the 4-class head
    assert all(torch.equal(frozen[n], checkpoint[n]) for n in shared)


def test_the_docs_table_labels_each_cell_and_averages_its_seeds(tmp_path):
    """scripts/lora_table.py: one row a grid cell, labelled from its config (federation, fine-tuning, budget with
    the calibrated z), its numbers fedflat report's on that cell's completed seeds."""
    import importlib.util
    import json

    import yaml

    from fedflat.config import resolve

    script = Path(__file__).resolve().parents[1] / "scripts" / "lora_table.py"
    spec = importlib.util.spec_from_file_location("lora_table", script)
    lora_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lora_table)

    cells = {c.name: c for c in load_sweep("lora_fmnist_sweep").cells()}
    runs = {"lora-ffa__seed0": ([0.6, 0.72], 4902), "lora-ffa__seed1": ([0.7, 0.76], 4902),
            "full-fedavg__seed0": ([0.5, 0.8], 88470), "dp-eps2-lora-fedsam__seed0": ([0.4, 0.5], 7206)}
    for name, (accs, params) in runs.items():
        folder = tmp_path / name
        folder.mkdir()
        tree = resolve(cells[name].config)
        if tree.get("privacy"):
            tree["privacy"]["noise_multiplier"] = 1.234  # (what the calibration writes into a run's config.yaml)
        (folder / "config.yaml").write_text(yaml.safe_dump(tree))
        lines = [{"round": 3 * (t + 1), "test_acc": a, "up_bytes": 4 * params + 4, "train_seconds": 3.0 * (t + 1)}
                 for t, a in enumerate(accs)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
        (folder / "summary.json").write_text(json.dumps({
            "status": "completed", "rounds": 6, "final_test_acc": accs[-1], "best_test_acc": max(accs),
            "train_seconds": 6.0, "parameters": params, "up_vectors": 1, "down_vectors": 1}))
    order = [c for c in cells if c in runs]  # the sweep's order, as its sweep.json lists the cells
    (tmp_path / "sweep.json").write_text(json.dumps({"cells": [{"name": c} for c in order]}))
    rows = lora_table.table(tmp_path, [0.7, 0.8]).splitlines()[2:]
    assert rows == [
        "| 100 clients, 10 a round | LoRA r=8, A frozen | FFA-LoRA | – | – | 74.00 ± 2.83 | 74.00 ± 2.83 | 4.5 | – "
        "| 4,902 | 19.6 | 1.0 |",  # rounds to 70%: 6 and 3; (72 + 76) / 2, sample std 2.83; 4 * 4902 + 4 bytes
        "| 100 clients, 10 a round | full fine-tuning | FedAvg (1 seed) | – | – | 80.00 | 80.00 | 6 | 6 | 88,470 "
        "| 353.9 | 1.0 |",
        "| 500 clients, Poisson q=0.1 | LoRA r=8 | FedSAM (1 seed) | rho=0.01 | 2 (z=1.23) | 50.00 | 50.00 | – | – "
        "| 7,206 | 28.8 | 1.0 |"]
