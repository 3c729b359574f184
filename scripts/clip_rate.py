"""How often the clip binds: the norms the local steps clip, over the first rounds of FedWMSAM's FMNIST Table 1
setting (``papers/fedwmsam_table1_fmnist``) on its two strong columns (docs/algorithms.md, "What the clip bounds").

    python scripts/clip_rate.py fedavg scaffold feddyn fedwmsam "fedlesam-s algo.lamb=0.1 algo.rho=0.01"

Each argument is a method and its overrides; for each it prints the client steps, how many were clipped (the norm
the clip acts on above ``train.clip``), the largest norm and the 99th percentile. The norms are read where the
engine computes the clip's scale (``fedflat.engine.client.clip_scale``), which this script wraps.
"""
from __future__ import annotations

import sys

import torch

import fedflat
import fedflat.engine.client as client
from fedflat.config import config_file, load_config, read_yaml

ROUNDS = 30
SPLITS = ({"scheme": "dirichlet_balanced", "alpha": 0.1}, {"scheme": "pathological", "classes": 3})


def clipped_norms(method: str, setting: dict) -> torch.Tensor:
    """The norms the clip acted on in every client step of ``method`` (name and overrides) on both splits."""
    name, *overrides = method.split()
    norms: list[float] = []
    scale = client.clip_scale

    def recording(D: torch.Tensor, max_norm: float) -> torch.Tensor:
        norms.extend(D.norm(dim=-1).tolist())
        return scale(D, max_norm)

    client.clip_scale = recording
    try:
        for split in SPLITS:
            tree = {**setting, "data": {**setting["data"], "partition": split}}
            cfg = load_config(None, [f"algo={name}", *overrides, f"rounds={ROUNDS}", f"eval.every={ROUNDS}",
                                     "threads=1"], base=tree)
            fedflat.run(cfg, save=False, progress=False)
    finally:
        client.clip_scale = scale
    return torch.tensor(norms)


def main() -> int:
    torch.set_num_threads(1)
    setting = read_yaml(config_file("papers/fedwmsam_table1_fmnist").read_text())["config"]
    for method in sys.argv[1:]:
        seen = clipped_norms(method, setting)
        print(f"{method}: {len(seen)} client steps, {int((seen > setting['train']['clip']).sum())} clipped, "
              f"largest {float(seen.max()):.1f}, 99th percentile {float(seen.quantile(0.99)):.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
