"""Checks for a researcher's own part, to call from their own tests (docs/extending.md):

    from fedflat.testing import check_part
    check_part(AdaptiveSAM)          # raises AssertionError naming what failed; returns what it measured

:func:`check_part` runs the part on a tiny synthetic problem (6 clients of unequal sizes, an MLP, a few rounds, with
the contract's debug mode on) and asserts what every built-in part satisfies:

1. it keeps the contract: no hook modifies in place a tensor it does not own (``FEDFLAT_CHECK_CONTRACT``);
2. both engines agree: one client at a time and a vectorized cohort (padded and masked) give the same model, to
   float32 rounding of the steps taken (unless the part declares ``supports_vectorized = False``);
3. it composes: it runs in another method (a perturbation on SCAFFOLD, any other role on FedSAM);
4. its state survives a checkpoint: stopped after round ``R - 1`` and resumed, the run ends bit for bit where an
   uninterrupted run ends;
5. the run exercised a client twice (its kept state read back): ``report["repeat_participations"]`` counts the
   participations that were a client's second or later.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from fedflat.core import PARTS, RECIPES, Part, register_part
from fedflat.core.contract import CHECK_ENV

U32 = 2.0 ** -24  # float32's unit roundoff
# Units of float32 rounding per local step by which two summation orders (one client at a time, a vmapped cohort)
# may move the model, normwise, on the tiny problem: a step's few rounded operations per entry, with room for their
# growth over a short run. A semantic difference between the engines is orders of magnitude larger.
ROUNDINGS_PER_STEP = 16

TINY: dict[str, Any] = {
    "seed": 0, "rounds": 3,
    "data": {"name": "synthetic", "num_clients": 6,
             "options": {"shape": [1, 4, 4], "num_classes": 3, "train_size": 180, "test_size": 60},
             "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}},
    "model": {"name": "mlp", "hidden": [8]},
    "train": {"local_epochs": 2, "batch_size": 7, "lr": 0.1},
    "sampling": {"clients_per_round": 3},
    "threads": 1,
}
HOST_RECIPE = {"perturbation": "scaffold", "filter": "fedsam", "correction": "fedsam", "aggregation": "fedsam",
               "server": "fedsam", "personalization": "fedsam"}


@contextmanager
def _contract_checked() -> Iterator[None]:
    before = os.environ.get(CHECK_ENV)
    os.environ[CHECK_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHECK_ENV, None)
        else:
            os.environ[CHECK_ENV] = before


def _section(part: type[Part], recipe: str | None) -> dict[str, Any]:
    """The method that runs ``part``: its own recipe, or FedAvg with the part in its role."""
    if recipe is not None:
        if RECIPES[recipe].part_names()[part.role] != part.name:
            raise ValueError(f"recipe '{recipe}' has {part.role} '{RECIPES[recipe].part_names()[part.role]}', "
                             f"not '{part.name}'")
        return {"name": recipe}
    return {"name": "fedavg", part.role: part.name}


def _run(tree: dict[str, Any], algo: dict[str, Any], *overrides: str, **where: Any):
    from fedflat.experiments.runner import run_experiment

    return run_experiment({**tree, "algo": algo}, overrides=list(overrides), progress=False, **where)


def check_part(part: type[Part], *, recipe: str | None = None, tree: dict[str, Any] | None = None,
               algo: dict[str, Any] | None = None) -> dict[str, Any]:
    """Runs the checks of this module on ``part`` (registered here if it is not yet) and returns what they
    measured; a failed check raises ``AssertionError`` saying which and by how much.

    ``recipe``: a recipe of the part to run (default: FedAvg with the part in its role); ``algo``: further keys of
    the ``algo`` section (the part's hyperparameters, ``{"perturbation": {"rho": 0.1}}``); ``tree``: another tiny
    config than :data:`TINY`."""
    if PARTS[part.role].get(part.name) is not part:
        register_part(part)
    tree = dict(tree or TINY)
    method = {**_section(part, recipe), **(algo or {})}
    report: dict[str, Any] = {"part": f"{part.role} '{part.name}'", "method": method}
    with _contract_checked(), tempfile.TemporaryDirectory(prefix="fedflat-check-") as tmp:
        sequential = _run(tree, method, "engine=sequential", save=False)
        report["contract"] = "kept"
        allowed = rounding_allowed(tree)
        if part.supports_vectorized:
            vectorized = _run(tree, method, "engine=vectorized", save=False)
            gap = relative_gap(vectorized.final_parameters, sequential.final_parameters)
            assert gap <= allowed, (f"{report['part']}: the engines disagree: relative difference {gap:.2e} of the "
                                    f"final models, more than float32 rounding allows ({allowed:.1e})")
            report["engines"] = {"relative_difference": gap, "allowed": allowed}
        host = HOST_RECIPE[part.role]
        composed = _run(tree, {"name": host, part.role: part.name, **(algo or {})}, save=False)
        assert torch.isfinite(composed.final_parameters).all(), f"{report['part']} in {host}: a non-finite model"
        report["composed"] = composed.summary["algorithm"]
        report["checkpoint"] = _resume_is_exact(tree, method, Path(tmp))
        report["repeat_participations"] = repeats = _repeat_participations(tree, method)
        assert repeats > 0, (f"{report['part']}: no client took part twice in this tree's {tree['rounds']} rounds, so "
                             "no kept state was read back: more rounds or clients_per_round")
    return report


def _repeat_participations(tree: dict[str, Any], method: dict[str, Any]) -> int:
    """How many of the run's participations were a client's second or later (the sampling redrawn, nothing run)."""
    from fedflat.config import load_config
    from fedflat.engine.simulation import Simulation

    sim = Simulation(load_config(None, [], base={**tree, "algo": method}))
    seen = [int(c) for t in range(tree["rounds"]) for c in sim.server.sample_clients(t).tolist()]
    return len(seen) - len(set(seen))


def rounding_allowed(tree: dict[str, Any]) -> float:
    """The relative distance two float32 summation orders may put between the final models of the run ``tree``:
    :data:`ROUNDINGS_PER_STEP` units of rounding per step of the most steps one client can take."""
    train = tree["train"]  # every sample, every epoch, every round
    per_epoch = -(-tree["data"]["options"]["train_size"] // train["batch_size"])
    return ROUNDINGS_PER_STEP * tree["rounds"] * train["local_epochs"] * per_epoch * U32


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``: how far ``a`` is from ``b``, relative to ``b`` (L2 norms over all entries)."""
    return float((a - b).norm() / b.norm())


def _resume_is_exact(tree: dict[str, Any], method: dict[str, Any], tmp: Path) -> str:
    from fedflat.experiments.resume import metrics_equal, resume

    rounds = tree["rounds"]
    whole = _run(tree, method, "checkpoint_every=1", run_dir=tmp / "whole")
    _run(tree, method, "checkpoint_every=1", f"rounds={rounds - 1}", run_dir=tmp / "stopped")
    resumed = resume(tmp / "stopped", overrides=[f"rounds={rounds}"], progress=False)
    assert torch.equal(resumed.final_parameters, whole.final_parameters), (
        f"resumed after round {rounds - 1}, the run ends elsewhere than an uninterrupted one: some state of the "
        "part is not in the server state, the client state or the broadcast (declare it: server_state, keeps, "
        "holds)")
    assert metrics_equal(resumed.metrics, whole.metrics), "resumed, the run's metrics differ from uninterrupted"
    return f"resumed after round {rounds - 1}: bit for bit"
