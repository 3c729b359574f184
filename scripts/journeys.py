"""How many of fedflat's files and functions three journeys through the code run (docs/architecture.md, issue 58).

    python scripts/journeys.py [--json OUT]

Each journey runs on the tests' tiny problem with a profiler hook that records every fedflat function entered
(Python frames whose file is under ``fedflat/``; comprehensions, lambdas and generator expressions fold into their
function). The three journeys of the issue:

1. **one FedSAM round**: ``Simulation.run_round`` of FedSAM, after a warm-up round (what a round runs, not the
   first round's one-time work);
2. **a client's upload under central DP and top-k**: the functions a FedAvg round with ``privacy`` (central) and
   ``compression: topk`` runs that a plain FedAvg round does not (the upload path's own work);
3. **a plugin part reaching a worker**: reading a config that names a plugin (examples/fedasam) through to the client
   runtime a worker builds from the run's ``WorkerSpec`` (``build_client_runtime``, in this process: a Ray worker runs
   the same functions after unpickling the spec).

The counts are this script's method, comparable between commits (run it on each), not with a count made by reading.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
PACKAGE = str(ROOT / "fedflat")
FOLDED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>", "<module>")


class Visits:
    """The fedflat files and functions entered while active."""

    def __init__(self) -> None:
        self.functions: set[tuple[str, str]] = set()

    def __enter__(self) -> "Visits":
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def _hook(self, frame, event, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE) or code.co_name in FOLDED:
            return
        self.functions.add((str(Path(code.co_filename).relative_to(ROOT)), code.co_qualname))

    @property
    def files(self) -> set[str]:
        return {f for f, _ in self.functions}


def _config(*overrides: str):
    from conftest import tiny_config

    return tiny_config("device=cpu", "threads=1", *overrides)


def _round_visits(*overrides: str) -> Visits:
    """What a warm round (the second) of the tiny problem with ``overrides`` runs."""
    from fedflat.engine.simulation import Simulation

    sim = Simulation(_config(*overrides))
    sim.run_round(0)
    with Visits() as visits:
        sim.run_round(1)
    return visits


def fedsam_round() -> Visits:
    return _round_visits("algo=fedsam", "algo.rho=0.1")


def dp_topk_upload() -> Visits:
    plain = _round_visits()
    private = _round_visits("privacy.clip=0.5", "privacy.noise_multiplier=1.0",
                            "compression={name: topk, ratio: 0.5}")
    extra = Visits()
    extra.functions = private.functions - plain.functions
    return extra


def plugin_to_worker() -> Visits:
    import yaml
    from conftest import tiny_tree

    folder = Path(tempfile.mkdtemp())
    try:
        shutil.copy(ROOT / "examples" / "fedasam" / "fedasam.py", folder / "fedasam.py")
        tree = {**tiny_tree(rounds=1, threads=1, device="cpu"), "plugins": ["fedasam.py"],
                "algo": {"name": "myfedasam", "rho": 0.3}}
        (folder / "run.yaml").write_text(yaml.safe_dump(tree))
        from fedflat.config import load_config
        from fedflat.engine.runtime import build_client_runtime
        from fedflat.engine.simulation import Simulation

        with Visits() as visits:
            cfg = load_config(folder / "run.yaml")
            sim = Simulation(cfg)
            build_client_runtime(sim.worker_spec(), sim.batches, sim.device)
        return visits
    finally:
        shutil.rmtree(folder)


JOURNEYS = {"one FedSAM round": fedsam_round, "a client's upload under central DP + top-k": dp_topk_upload,
            "a plugin part reaching a worker": plugin_to_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the counts and the functions here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, journey in JOURNEYS.items():
        visits = journey()
        out[name] = {"files": len(visits.files), "functions": len(visits.functions),
                     "visited": sorted(f"{f}:{q}" for f, q in visits.functions)}
        print(f"{name}: {len(visits.files)} files, {len(visits.functions)} functions")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
