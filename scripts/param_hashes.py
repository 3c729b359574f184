"""Final-parameter hashes of a fixed set of short runs: every recipe on both engines, a few compositions.

A refactor keeps every number: record the hashes before a structural change and check them after, on the
same machine (the hashes depend on the CPU's arithmetic, so they are a development check, not a CI test).

    python scripts/param_hashes.py --out before.json           # record
    python scripts/param_hashes.py --check before.json         # compare; exit 1 naming every run that moved
    python scripts/param_hashes.py --stages --out before.json  # also the upload path: DP, compression, attacks,
                                                                # robust rules, validation (every recipe under some)
    python scripts/param_hashes.py --match fedwmsam --check before.json  # only the runs naming fedwmsam

scripts/param_hashes.json holds the hashes of the last change that moved numbers on purpose, with the machine they
were recorded on (its "_machine" entry): on that machine, the check of a refactor against it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings

import torch

import fedflat
from fedflat.algorithms import RECIPES

# The tiny problem of the tests (tests/conftest.py) with unequal local step counts (Dirichlet sizes), partial
# participation, a binding clip, weight decay and a decaying learning rate, so every branch of the step runs.
BASE = {
    "seed": 0, "rounds": 3,
    "data": {"name": "synthetic", "num_clients": 6,
             "options": {"shape": [1, 4, 4], "num_classes": 3, "train_size": 180, "test_size": 60},
             "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}},
    "model": {"name": "mlp", "hidden": [8]},
    "algo": {"name": "fedavg"},
    "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.1, "clip": 0.5, "weight_decay": 1e-3, "lr_decay": 0.99},
    "sampling": {"clients_per_round": 3},
}
COMPOSITIONS = [
    ["algo=fedacg", "algo.aggregation=scam"],
    ["algo=fedscam", "algo.correction=acg"],
    ["algo=fedlesam", "algo.filter=fft", "algo.correction=scaffold"],
    ["algo=fedsam", "algo.personalization=fedper"],
]


# A recipe of low-rank adapters (FFA-LoRA, FedSA-LoRA) on the MLP's hidden layer, its head trained whole.
ADAPTERS = ["adapter.r=2", "adapter.target_modules=[body.0]"]

# Convolutions and image inputs: a few methods on the CNN (8x8 images, 2 rounds).
CNN = ["model=cnn", "model.padding=2", "data.options.shape=[1,8,8]", "rounds=2"]
CNN_METHODS = ["fedavg", "fedsam", "scaffold", "fedlesam", "feddyn", "fedwmsam"]


# The upload path's stages, alone and together (``--stages``): the runs none of the above has.
FIVE = ["sampling.clients_per_round=5"]
CENTRAL = ["privacy.mode=central", "privacy.noise_multiplier=0.5", "privacy.clip=0.3"]
LOCAL = ["privacy.mode=local", "privacy.noise_multiplier=0.1", "privacy.clip=0.3"]
TOPK, QSGD = ["compression.name=topk", "compression.ratio=0.3"], ["compression.name=qsgd", "compression.levels=4"]
STAGES = [
    CENTRAL, LOCAL, [*CENTRAL, "privacy.adaptive=true", "privacy.count_noise=1.0"],
    ["privacy.level=instance", "privacy.noise_multiplier=0.5", "privacy.clip=0.3"],
    ["algo=scaffold", *CENTRAL], ["algo=fedsam", *CENTRAL], ["algo=feddyn", *LOCAL],
    TOPK, [*TOPK, "compression.error_feedback=true"], QSGD, [*TOPK, *CENTRAL], [*QSGD, *CENTRAL],
    ["attack.name=sign_flip", "attack.fraction=0.3"], ["attack.name=gaussian", "attack.fraction=0.3"],
    ["attack.name=label_flip", "attack.fraction=0.3"],
    ["attack.name=backdoor", "attack.fraction=0.3", "attack.boost=3", "attack.trigger_size=1"],
    ["attack.name=alie", "attack.fraction=0.3", *FIVE], ["attack.name=ipm", "attack.fraction=0.3", *FIVE],
    ["attack.name=sign_flip", "robust.name=median", *FIVE],
    ["attack.name=sign_flip", "robust.name=trimmed_mean", "robust.beta=0.2", *FIVE],
    ["attack.name=sign_flip", "robust.name=krum", *FIVE],
    ["attack.name=sign_flip", "robust.name=bulyan", "robust.f=0", *FIVE],
    ["attack.name=sign_flip", "robust.name=norm_bound", "robust.bound=0.2", *FIVE],
    ["attack.name=sign_flip", "robust.name=centered_clip", "robust.tau=0.1", "robust.iterations=2", *FIVE],
    ["attack.name=gaussian", "attack.fraction=0.3", "robust.name=norm_bound", "robust.bound=0.2", *LOCAL, *FIVE],
    ["attack.name=sign_flip", *TOPK, *CENTRAL],
    ["validation.max_norm=0.12"], ["validation.max_norm=0.12", *TOPK],
    ["validation.max_norm=0.12", *QSGD, "attack.name=gaussian", "attack.std=5"],
    ["algo=fedsam", "algo.filter=l2", "algo.filter.rho=0.03"], ["algo=ditto"],
]


def runs(stages: bool = False) -> list[list[str]]:
    """Every recipe and composition, and the CNN's methods, on both engines; with ``stages`` also :data:`STAGES`,
    every recipe under central DP and under a median against sign flips, and compressed, checked uploads."""
    methods = ([[f"algo={name}", *(ADAPTERS if RECIPES[name].adapter else [])] for name in sorted(RECIPES)]
               + COMPOSITIONS
               + [[f"algo={name}", *CNN] for name in CNN_METHODS])
    if stages:
        dp = ["privacy.mode=central", "privacy.noise_multiplier=0.3", "privacy.clip=0.3"]
        methods += (STAGES + [[f"algo={n}", *dp] for n in sorted(RECIPES)]
                    + [[f"algo={n}", "robust.name=median", "attack.name=sign_flip", *FIVE] for n in sorted(RECIPES)]
                    + [[f"algo={n}", *QSGD, "validation.max_norm=0.2", *FIVE]
                       for n in ("scaffold", "feddyn", "fedsmoo", "fedspeed")])
    return [m + [f"engine={engine}"] for m in methods for engine in ("sequential", "vectorized")]


def digest(overrides: list[str]) -> str:
    try:
        history = fedflat.run(BASE, overrides=overrides, save=False, progress=False)
    except Exception as err:  # a method the vectorized engine refuses: its message is its record
        return f"error: {type(err).__name__}"
    return hashlib.sha256(history.final_parameters.numpy().tobytes()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the hashes to this JSON file")
    parser.add_argument("--check", help="compare with the hashes in this JSON file")
    parser.add_argument("--stages", action="store_true", help="also the upload path's stages (about 480 runs)")
    parser.add_argument("--match", default="", help="only the runs whose overrides contain this text (with --check:"
                                                    " compared with those runs' recorded hashes)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    hashes = {" ".join(o): digest(o) for o in runs(args.stages) if args.match in " ".join(o)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1)
    if not args.check:
        json.dump(hashes, sys.stdout, indent=1)
        return 0
    with open(args.check) as f:
        before = json.load(f)
    before = {k: v for k, v in before.items() if not k.startswith("_") and args.match in k}  # ("_machine")
    moved = [k for k in before if hashes.get(k) != before[k]]
    for k in moved:
        print(f"moved: {k}: {before[k]} -> {hashes.get(k)}")
    print(f"{len(before) - len(moved)} of {len(before)} runs unchanged")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
