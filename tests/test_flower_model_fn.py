"""A Flower simulation of a user's own model (``model_fn``, as ``fedflat.run`` takes it): the server and every
virtual SuperNode build the same module, and the run equals ``fedflat.run(..., model_fn=...)`` number for number."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("flwr")

import fedflat  # noqa: E402
from fedflat.api import as_config  # noqa: E402
from fedflat.flower import simulate  # noqa: E402

NOT_COMPARED = {"seconds", "eval_seconds", "train_seconds", "store", "wire_up_bytes", "wire_down_bytes"}


class Bilinear(nn.Module):
    """No built-in model: a bilinear layer between two linear maps of the flattened 1x4x4 image."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 5), nn.Linear(16, 5)
        self.mix = nn.Bilinear(5, 5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = x.flatten(1)
        return self.head(torch.tanh(self.mix(self.a(x), self.b(x))))


def bilinear() -> nn.Module:
    return Bilinear()


@pytest.mark.slow  # a Flower simulation (Ray workers): about a minute on 2 busy cores
@pytest.mark.parametrize("algo", ["fedavg", "ditto"])
def test_a_flower_simulation_of_a_model_fn_equals_fedflat_run(tiny, tmp_path, algo):
    """Ditto's personal models stay on the nodes, which evaluate them (the server pools the counts)."""
    cfg = tiny(f"algo={algo}", "rounds=2", "eval.every=1", "threads=1")
    ours = fedflat.run(cfg, model_fn=bilinear, save=False, progress=False)
    theirs = simulate(cfg, supernodes=3, out=tmp_path, progress=False, model_fn=bilinear)
    assert ours.summary["parameters"] == sum(p.numel() for p in Bilinear().parameters()) == \
        theirs.summary["parameters"]
    assert torch.equal(ours.final_parameters, theirs.final_parameters)
    assert len(ours.metrics) == len(theirs.metrics) == 2
    for a, b in zip(ours.metrics, theirs.metrics):
        for key in set(a) - NOT_COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
    assert theirs.config["model"]["name"] == "user:bilinear"
