"""What ``precision: bf16`` and ``channels_last: true`` cost in accuracy for the convolutional models on the CPU: the
same federated runs in float32 (the default) and with the option, seed by seed, on real data.

    python scripts/precision_accuracy.py --models cnn,resnet20 --options precision=bf16,channels_last=true \\
        --seeds 0,1 --out precision.json

Each run is FedAvg on Fashion-MNIST (the real data, offline: 60,000 / 10,000 images 1x28x28), 100 clients of a
Dirichlet 0.3 split, 1 local epoch of batch 50, lr 0.05, weight decay 1e-3, clip 10; the CNN 10 clients a round for
30 rounds, ResNet-20-GN 5 a round for 20 (its step is 4x the CNN's). Sequential engine, one thread. The final test
accuracy of each option's run is printed beside the float32 run of the same seed, whose spread over seeds is the scale
a difference is read against. docs/benchmarks.md has the numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import fedflat

SETTING = {
    "data": {"name": "fmnist", "num_clients": 100, "partition": {"scheme": "dirichlet", "alpha": 0.3, "min_size": 10}},
    "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.05, "weight_decay": 1e-3, "clip": 10.0},
    "algo": {"name": "fedavg"}, "engine": "sequential", "threads": 1,
}
MODELS = {"cnn": {"rounds": 30, "sampling": {"clients_per_round": 10}},
          "resnet20": {"rounds": 20, "sampling": {"clients_per_round": 5}}}


def run(model: str, option: str | None, seed: int) -> dict:
    """One run's final test accuracy and seconds."""
    tree = {**SETTING, **MODELS[model], "model": {"name": model}, "seed": seed,
            "eval": {"every": MODELS[model]["rounds"]}}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = fedflat.run(tree, overrides=[option] if option else [], save=False, progress=False)
    return {"model": model, "option": option or "float32", "seed": seed, "final_test_acc": history.final_test_acc,
            "gradient": history.summary.get("gradient"), "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,resnet20")
    p.add_argument("--options", default="precision=bf16,channels_last=true")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--out", default=None, help="write every run's result here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for model in args.models.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for option in [None, *args.options.split(",")]:
                results.append(run(model, option, seed))
                r = results[-1]
                print(f"{model:<9} {r['option']:<20} seed {seed}: acc {r['final_test_acc']:.4f} "
                      f"({r['gradient']}, {r['seconds']:.0f} s)", flush=True)
    for model in args.models.split(","):
        base = {r["seed"]: r["final_test_acc"] for r in results if r["model"] == model and r["option"] == "float32"}
        for option in args.options.split(","):
            diffs = [r["final_test_acc"] - base[r["seed"]] for r in results
                     if r["model"] == model and r["option"] == option]
            print(f"{model:<9} {option:<20} minus float32, seed by seed: "
                  f"{' '.join(f'{d:+.4f}' for d in diffs)} (mean {statistics.mean(diffs):+.4f}; float32 over seeds "
                  f"{min(base.values()):.4f}-{max(base.values()):.4f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
