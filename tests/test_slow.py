"""Longer end-to-end runs (`make test-slow`): the quickstart in full and real Fashion-MNIST."""
from __future__ import annotations

from pathlib import Path

import pytest

import fedflat

pytestmark = pytest.mark.slow

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def test_full_quickstart_reaches_the_documented_accuracy():
    """The README's number: FedSAM on the digits quickstart, 100 rounds, about 0.96 (chance 0.10)."""
    hist = fedflat.run(None, save=False, progress=False)
    assert hist.summary["status"] == "completed"
    assert hist.summary["final_test_acc"] > 0.93


@pytest.mark.skipif(not DEBIAN_FMNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
@pytest.mark.parametrize("algo", ["fedavg", "fedsam", "scaffold", "fedlesam", "fedwmsam"])
def test_fashion_mnist_non_iid_learns(algo):
    """Real data, a Dirichlet(0.3) split of Fashion-MNIST over 20 clients, 15 short rounds: every
    method of the FedWMSAM table gets well above chance (0.10)."""
    cfg = ["data=fmnist", "data.num_clients=20", "data.partition.alpha=0.3", f"algo={algo}",
           "model.hidden=[100]", "rounds=15", "train.local_steps=10", "eval.every=15",
           "sampling.clients_per_round=5"]
    hist = fedflat.run({"rounds": 15}, overrides=cfg, save=False, progress=False)
    assert hist.summary["final_test_acc"] > 0.6
