"""Bytes on the wire of a Flower simulation: LoRA against full fine-tuning of the same model.

    python scripts/lora_wire.py                          # RoBERTa-base and ViT-B/16 shapes, random weights
    python scripts/lora_wire.py --models roberta-base --json wire.json

For each model, one round of FedAvg in a Flower simulation (``fedflat.flower.simulate``: ``--nodes`` virtual
SuperNodes, every one of ``--clients`` clients sampled, one local step of ``--batch`` samples) twice: with
``adapter.r=R`` (the adapter section's default targets; the classifier head trained whole) and without an adapter
section (every parameter trained and sent). Reported per round: the trained parameters ``P`` and their bytes
(float32: the adapters' size, measured from the run's flat vector), fedflat's count of one client's upload
(``up_bytes``), and Flower's ``wire_up_bytes`` / ``wire_down_bytes`` (the arrays of the round's messages as Flower
serializes them: NumPy's header per array), with full fine-tuning's over LoRA's.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

#: model name -> the overrides of its model and data (a folder's config.json written for a Hugging Face one)
MODELS = {
    "roberta-base": ("text", ["data.options.shape=[128]", "data.options.tokens=50265", "data.options.num_classes=2"]),
    "vit-b16": ("image", ["model=vit", "model.variant=base16", "data.options.shape=[3,224,224]",
                          "data.options.num_classes=10"]),
}


def config(name: str, folder: str, a: argparse.Namespace, adapter: bool):
    from fedflat.config import load_config

    kind, extra = MODELS[name]
    model = ["model=hf", f"model.path={folder}", "model.random_weights=true"] if kind == "text" else []
    return load_config(None, [
        "seed=0", "rounds=1", "threads=1", "engine=sequential", "algo=fedavg", "data.name=synthetic",
        f"data.num_clients={a.clients}", "data.partition=iid", f"data.options.train_size={a.clients * a.batch}",
        f"data.options.test_size={a.batch}", *model, *extra, f"sampling.clients_per_round={a.clients}",
        f"train.batch_size={a.batch}", "train.local_steps=1", f"eval.batch_size={a.batch}",
        *([f"adapter.r={a.r}"] if adapter else [])])


def measure(name: str, a: argparse.Namespace) -> list[dict]:
    from fedflat.bench.workloads import ROBERTA_BASE
    from fedflat.flower import simulate

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(ROBERTA_BASE))
        for adapter in (True, False):
            cfg = config(name, folder, a, adapter)
            history = simulate(cfg, supernodes=a.nodes, out=Path(folder) / "runs", progress=False)
            line = history.metrics[-1]
            trained = int(history.final_parameters.numel())
            rows.append({"model": name, "training": f"LoRA r={a.r}" if adapter else "full", "trained": trained,
                         "trained_bytes": 4 * trained, "frozen": history.summary.get("frozen_parameters"),
                         "up_bytes": line["up_bytes"], "wire_up_bytes": line["wire_up_bytes"],
                         "wire_down_bytes": line["wire_down_bytes"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict], a: argparse.Namespace) -> str:
    lines = [f"one FedAvg round, {a.clients} clients on {a.nodes} Flower nodes (bytes)",
             f"{'model':<13} {'training':<10} {'trained P':>11} {'4P':>13} {'up_bytes':>13} {'wire up':>13} "
             f"{'wire down':>13} {'up x':>7}"]
    lora = {r["model"]: r for r in rows if r["training"] != "full"}
    for r in rows:
        ratio = r["wire_up_bytes"] / lora[r["model"]]["wire_up_bytes"]
        lines.append(f"{r['model']:<13} {r['training']:<10} {r['trained']:>11,} {r['trained_bytes']:>13,} "
                     f"{int(r['up_bytes']):>13,} {int(r['wire_up_bytes']):>13,} {int(r['wire_down_bytes']):>13,} "
                     f"{ratio:>7.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="roberta-base,vit-b16")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = [row for name in a.models.split(",") for row in measure(name, a)]
    print(table(rows, a))
    print(f"load average {os.getloadavg()}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
