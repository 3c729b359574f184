"""Paired in-process CPU time of a speed path: two Simulations of the same config in one process, the path on in one
and off in the other, their rounds alternated (which goes first alternates too), process CPU seconds per round.

    python scripts/paired_speed.py --workload W1 --algo fedavg --rounds 8      # the hand-derived MLP gradient
    python scripts/paired_speed.py --lever native --algo fedsam --rounds 6     # its native operator vs its Python
    python scripts/paired_speed.py --workload W2 --rounds 4                    # the CNN's (W2), against autograd

``--lever hand`` (default): "off" is the oracle with its general backend, autograd client by client, in place of the
hand-derived gradient's (``oracle.backend = oracle.backend.general``). ``--lever native``: "off" is the hand-derived
gradient's Python method (``oracle.backend.hand.native = None``: for the CNN, ATen's pooling in place of the native
kernels), "on" its native operator (fedflat/engine/native). Both runs must end with the same
parameters (checked). Load changes the absolute times; the pairing keeps the ratio (docs/benchmarks.md, "A
hand-derived MLP gradient" and "The native MLP gradient").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedflat.bench.workloads import WORKLOADS
from fedflat.config import load_config
from fedflat.engine.gradients import HandMLP
from fedflat.engine.simulation import Simulation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W1")
    p.add_argument("--algo", default="fedavg")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--lever", choices=["hand", "native"], default="hand")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, ["device=cpu", f"algo={a.algo}", "engine=sequential", "threads=1"],
                      base=WORKLOADS[a.workload].tree)
    on, off = Simulation(cfg), Simulation(cfg)
    if not isinstance(on.oracle.backend, HandMLP):
        raise SystemExit(f"{a.workload} {a.algo}: no hand-derived gradient is taken here")
    if a.lever == "native":
        if on.oracle.backend.hand.native is None:
            raise SystemExit(f"{a.workload} {a.algo}: the native operator is not taken here")
        off.oracle.backend.hand.native = None
    else:
        off.oracle.backend = off.oracle.backend.general
    print(f"{a.workload} {a.algo}: {a.lever} on/off")
    cpu = {"on": [], "off": []}
    for t in range(a.rounds):
        for name in (("on", "off") if t % 2 == 0 else ("off", "on")):
            sim = on if name == "on" else off
            start = time.process_time()
            sim.run_round(t)
            cpu[name].append(time.process_time() - start)
        print(f"round {t}: on {cpu['on'][-1]:.3f} s, off {cpu['off'][-1]:.3f} s, "
              f"ratio {cpu['on'][-1] / cpu['off'][-1]:.3f}", flush=True)
    ratios = [x / y for x, y in zip(cpu["on"], cpu["off"])]
    same = torch.equal(on.server.w, off.server.w)
    print(f"CPU s/round (median): on {statistics.median(cpu['on']):.3f}, off {statistics.median(cpu['off']):.3f}; "
          f"on/off total {sum(cpu['on']) / sum(cpu['off']):.3f}, per round median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); same final parameters: {same}")


if __name__ == "__main__":
    main()
