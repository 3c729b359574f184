r"""Server-side SWA (Caldarola, Caputo and Ciccone, *Improving Generalization in Federated Learning by Seeking Flat
Minima*, ECCV 2022; after Izmailov et al.'s stochastic weight averaging, UAI 2018): late in training the server
averages the global models of successive rounds, while clients keep training from FedAvg's iterate with a cyclic
local rate. ``algo.server=swa`` on any method (FedAvg, FedSAM, FedASAM: the recipes ``fedavg-swa``, ``fedsam-swa``,
``fedasam-swa``).

The server keeps FedAvg's iterate :math:`x^t` (``swa.x``; clients start from it) and the SWA model :math:`w_{SWA}`, which is
the run's global model :math:`w^t` (evaluated, checkpointed, returned) from the start round :math:`s` on; before :math:`s`
:math:`w^t = x^t` and the method is its base method bit for bit. With :math:`c` the cycle length (rounds) and
:math:`\alpha_1 = \eta_l^t` the run's rate, :math:`\alpha_2` the SWA rate, each round :math:`t \ge s` trains at (Izmailov et al., eq. 2)

.. math::

    \eta(t) = (1 - \tau)\, \alpha_1 + \tau\, \alpha_2, \qquad \tau = \frac{\mathrm{mod}(t', c) + 1}{c}

when :math:`c > 1` (a constant :math:`\alpha_1` when :math:`c = 1`), and :math:`x^{t+1} = x^t + \eta_g \sum_i p_i (w_{i,E} - x^t)`.
Two rules for when a model is collected into :math:`w_{SWA} \leftarrow (n\, w_{SWA} + x^{t+1}) / (n + 1)`, :math:`n \leftarrow n + 1`:

- ``rule=code`` (default; github.com/debcaldarola/fedsam, ``models/main.py:137-180``, ``main_utils.py:97``):
  :math:`t' = t` (the absolute round); :math:`w_{SWA} = x^s` at round :math:`s` with :math:`n = 0`, so the first collection replaces
  it; a model is collected after every round :math:`t > s` with :math:`\mathrm{mod}(t - s, c) = 0`;
- ``rule=izmailov`` (Izmailov et al.'s Algorithm 1): :math:`t' = t - s`; :math:`w_{SWA} = x^s` counts as one model (:math:`n = 1`);
  a model is collected at the end of every cycle, after rounds with :math:`\mathrm{mod}(t - s + 1, c) = 0`, where the rate is
  :math:`\alpha_2`.

:math:`s` = ``start_round``, or :math:`\lfloor \mathrm{start} \cdot T \rfloor` of the run's :math:`T` rounds (the code's default 0.75).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from fedflat.core import PartParams, Recipe, RoundContext, ServerUpdate, init, register_recipe

ITERATE = "swa.x"  # FedAvg's iterate x^t, where clients train from
COUNT = "swa.n"  # the models in w_SWA


class SWAParams(PartParams):
    start: float = Field(0.75, ge=0, le=1, description="s as a fraction of the run's rounds (the code's 75%)")
    start_round: int | None = Field(None, ge=0, description="s as a round number (0-based; overrides start)")
    cycle: int = Field(1, ge=1, description="c: rounds per cycle of the local rate and between collected models")
    swa_lr: float = Field(1e-4, ge=0, description="alpha_2: the local rate at the end of a cycle (c > 1)")
    rule: Literal["code", "izmailov"] = Field("code", description="when models are collected (module docstring)")


class SWAServer(ServerUpdate):
    """FedAvg's step on the iterate ``x^t``, and from round ``s`` on the running average of the iterates as the global
    model (module docstring)."""

    name = "swa"
    summary = "server-side SWA: from round s, the global model is the running mean of FedAvg's iterates (cyclic lr)"
    Params = SWAParams
    server_state = {ITERATE: init.model, COUNT: init.scalar(0, dtype=torch.long, device="cpu")}

    def start_round(self, ctx: RoundContext) -> int:
        if self.p.start_round is not None:
            return self.p.start_round
        return math.floor(self.p.start * ctx.settings.rounds)

    def cycle_position(self, ctx: RoundContext) -> int:
        r""":math:`\mathrm{mod}(t', c)`: the round's place in its cycle."""
        offset = 0 if self.p.rule == "code" else self.start_round(ctx)
        return (ctx.round - offset) % self.p.cycle

    def round_lr(self, ctx: RoundContext) -> float:
        if self.p.cycle == 1 or ctx.round < self.start_round(ctx):
            return ctx.lr
        tau = (self.cycle_position(ctx) + 1) / self.p.cycle
        return (1 - tau) * ctx.lr + tau * self.p.swa_lr

    def broadcast(self, ctx: RoundContext) -> torch.Tensor:
        return ctx.server[ITERATE]

    def collects(self, ctx: RoundContext, s: int) -> bool:
        if self.p.rule == "code":
            return ctx.round > s and (ctx.round - s) % self.p.cycle == 0
        return ctx.round >= s and (ctx.round - s + 1) % self.p.cycle == 0

    def step(self, ctx: RoundContext) -> torch.Tensor:
        x = ctx.w_start + ctx.settings.global_lr * ctx.aggregate(ctx.w_final - ctx.w_start)
        ctx.server[ITERATE] = x
        s = self.start_round(ctx)
        if ctx.round < s:
            return x
        n = int(ctx.server[COUNT])
        if ctx.round == s:  # w_SWA = x^s: the code's copy (n = 0), Izmailov's first model (n = 1)
            w_swa, n = ctx.w_start, 0 if self.p.rule == "code" else 1
        else:
            w_swa = ctx.w
        if self.collects(ctx, s):
            alpha = 1.0 / (n + 1)
            w_swa, n = w_swa * (1.0 - alpha) + x * alpha, n + 1  # the code's update_swa_model
        ctx.server[COUNT] = torch.tensor(n)
        ctx.log.update(swa_models=float(n))
        return w_swa.clone() if w_swa is ctx.w_start or w_swa is ctx.w else w_swa


SOURCE = "Caldarola et al., ECCV 2022 (github.com/debcaldarola/fedsam); Izmailov et al., UAI 2018"
for base, display, perturbation, defaults in (("fedavg", "FedAvg", "none", {}), ("fedsam", "FedSAM", "sam", {"rho": 0.01}),
                                              ("fedasam", "FedASAM", "asam", {"rho": 0.5, "eta": 0.01})):
    register_recipe(Recipe(
        name=f"{base}-swa", display=f"{display}+SWA", summary=f"{base} with server-side SWA from 75% of the rounds (algo.cycle, algo.swa_lr)",
        source=SOURCE, perturbation=perturbation, server="swa", defaults=defaults,
        tunable={"algo.cycle": (1, 5, 10), **({"algo.rho": (0.01, 0.05, 0.1)} if base == "fedsam" else {}),
                 **({"algo.rho": (0.1, 0.5, 0.7)} if base == "fedasam" else {})}))
