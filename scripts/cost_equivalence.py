"""Where issue 57's faster forms change numbers beyond the hash check's tiny problem, their runs against the earlier
forms': FedFFT's four-step band removal (long tensors) and direct one (short tensors with a few removed frequencies)
against the full transforms, FedSCAM's count sketch (the ``auto`` projection on models whose Gaussian matrix is not
cached) against the Gaussian.

    python scripts/cost_equivalence.py --rounds 50 --seeds 0,1,2 --out equivalence.json

Each method runs on Fashion-MNIST (the real data, offline) with the MLP 784-200-200-10 of W1 (its two weights are
long enough for the four-step form, its ``P d`` beyond the Gaussian's cache), 100 clients of a Dirichlet 0.1 split,
5 a round, 1 local epoch of batch 50, lr 0.1, once per seed and form; the final test accuracies of one form are then
compared with the other's seed spread. docs/benchmarks.md has the numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

import torch

import fedflat
import fedflat.algorithms.fedfft as fft

SETTING = {
    "rounds": 50,
    "data": {"name": "fmnist", "num_clients": 100, "partition": {"scheme": "dirichlet", "alpha": 0.1, "min_size": 10}},
    "model": {"name": "mlp", "hidden": [200, 200]},
    "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.1, "weight_decay": 1e-3, "clip": 10.0},
    "sampling": {"clients_per_round": 5}, "eval": {"every": 50},
}
# (method, form, overrides, (FOUR_STEP_MIN, DIRECT_MAX))
NEW = (fft.FOUR_STEP_MIN, fft.DIRECT_MAX)
FORMS = [
    ("fedfft", "full transforms (earlier)", [], (10 ** 12, 0)),
    ("fedfft", "four-step + direct (new)", [], NEW),
    ("fedscam", "gaussian (earlier)", ["algo.projection=gaussian"], NEW),
    ("fedscam", "auto: count sketch (new)", [], NEW),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default="fedfft,fedscam", help="comma-separated: fedfft, fedscam")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for method, form, overrides, (four_step_min, direct_max) in [f for f in FORMS if f[0] in args.methods.split(",")]:
        fft.FOUR_STEP_MIN, fft.DIRECT_MAX = four_step_min, direct_max
        accs = []
        for seed in seeds:
            history = fedflat.run({**SETTING, "rounds": args.rounds, "seed": seed, "algo": {"name": method}},
                                  overrides=overrides, save=False, progress=False)
            accs.append(history.final_test_acc)
            print(f"{method:8} {form:28} seed {seed}: final test accuracy {accs[-1]:.4f}", flush=True)
        rows.append({"method": method, "form": form, "accuracies": accs, "mean": statistics.mean(accs),
                     "spread": [min(accs), max(accs)]})
    for r in rows:
        print(f"{r['method']:8} {r['form']:28} mean {r['mean']:.4f} range {r['spread'][0]:.4f}-{r['spread'][1]:.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
