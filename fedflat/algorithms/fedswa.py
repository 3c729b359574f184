r"""FedSWA and FedMoSWA (Liu, Liu, Shang, Liu, Liu and Feng, *Improving Generalization in Federated Learning with
Highly Heterogeneous Data via Momentum-Based Stochastic Controlled Weight Averaging*, ICML 2025, arXiv 2507.20016;
code github.com/junkangLiu0/FedSWA).

**FedSWA**: stochastic weight averaging inside each round. A client's :math:`E_i` local steps follow a linear decay of
the rate from :math:`\eta_l` to :math:`\rho \eta_l` (one cycle per round), and the server averages the resulting models:

.. math::

    \eta_k = s\, \eta_l \Big(\big(1 - \tfrac{k}{E_i}\big) + \rho\, \tfrac{k}{E_i}\Big), \quad k = 0, \dots, E_i - 1;

    w_{i,k+1} = w_{i,k} - \eta_k d_k

(the schedule is the correction part ``swa``'s :meth:`step_lr`; :math:`s` = ``algo.scale``, 1 by default).

**FedMoSWA**: the same schedule with control variates that align the local steps with the global direction,
:math:`d_k = g_k + c - c_i`; after the round, with the mean rate :math:`\bar{\eta}`, the client's variate and the
server's, a moving average of the clients' (:math:`\gamma = 1` in round 0, where :math:`c = 0`):

.. math::

    c_i^+ = c_i - c + \frac{w^t - w_{i,E}}{E_i \bar{\eta}}, \qquad \bar{\eta} = s\, \eta_l \frac{1 + \rho}{2},

    c \leftarrow (1 - \gamma)\, c + \gamma \frac{1}{K} \sum_{i \in S} c_i^+

The paper's text could not be read here; the rules are the repository's (``main_FedSWA.py`` at f725be9), which
differs from what it runs in places, each an option or stated:

- ``update_FedSWA`` steps at :math:`2 \eta_k` (``lr=lr*2``, l.840, 849): ``algo.scale=2`` (default 1) — its README
  also doubles ``--lr`` for FedSWA;
- it hard-codes :math:`\rho = 0` (l.842; the ``--rho`` flag is unused there): ``algo.rho`` (default 0, the code's);
- the server averages plainly (``apply_weights_avg``, :math:`w + \mathrm{lg}\, \frac{1}{K} \sum_{i \in S} \Delta_i`; summaries of the paper describe an
  "EMA aggregation", which ``train.global_lr`` gives if it is :math:`w + \alpha \frac{1}{K} \sum_{i \in S} \Delta_i`);
- ``--alg MoFedSWA`` runs ``update_scafplus`` (l.1220: SCAFFOLD's step without the schedule, capped at ``--K``
  steps), never the ``update_FedMoSWA`` (l.864) that these rules follow; both upload :math:`c_i^+ - c` and update :math:`c`
  as above (``apply_weights_SCAF``: :math:`c + 0.4 \cdot \frac{1}{K} \sum_{i \in S} (c_i^+ - c)`, :math:`c = \frac{1}{K} \sum_{i \in S} c_i^+` first);
- ``update_FedMoSWA`` subtracts :math:`\eta_k (c - c_i)` after the optimizer's clipped step, where fedflat clips
  :math:`g + c - c_i` together (``train.clip_scope=loss``; equal while the clip of 10 does not bind);
- weight decay 1e-3 and the clip 10 are hard-coded there; in fedflat they are ``train`` settings.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import (ClientContext, Cohort, Correction, Direction, PartParams, Recipe, RoundContext, init,
                          register_recipe)

SERVER_VARIATE = "moswa.c"  # server state, broadcast: c
CLIENT_VARIATE = "moswa.c_i"  # client state: c_i
VARIATE_GAP = "moswa.dc"  # upload: c_i^+ - c


class SWAScheduleParams(PartParams):
    rho: float = Field(0.0, ge=0, le=1, description="the rate at the round's end, rho eta_l (the code: 0)")
    scale: float = Field(1.0, gt=0, description="s: the rate's factor (the code's update_FedSWA: 2)")


def decay_factor(cohort: Cohort, k: int, rho: float, scale: float, like: torch.Tensor) -> torch.Tensor:
    r"""``[C]``: :math:`s \big((1 - k/E_i) + \rho\, k/E_i\big)` of each client's :math:`E_i`."""
    frac = k / cohort.steps.to(device=like.device, dtype=like.dtype)
    return scale * ((1 - frac) + rho * frac)


class SWASchedule(Correction):
    r"""FedSWA's local steps: the direction itself, at the rate :math:`\eta_k` decaying linearly within the round."""

    name = "swa"
    summary = "FedSWA: the plain gradient at a rate decaying linearly from s eta_l to s rho eta_l within the round"
    Params = SWAScheduleParams
    schedules_steps = True

    def step_lr(self, ctx: ClientContext, cohort: Cohort, k: int) -> torch.Tensor:
        return decay_factor(cohort, k, self.p.rho, self.p.scale, ctx.w_start)


class MoSWAParams(SWAScheduleParams):
    gamma: float = Field(0.4, gt=0, le=1, description="the server variate's averaging weight (the code's 0.4)")


class MoSWA(SWASchedule):
    """FedMoSWA's local steps: :math:`d = g + c - c_i` at FedSWA's decaying rate; the variates as the module says."""

    name = "moswa"
    summary = "FedMoSWA: g + c - c_i at FedSWA's decaying rate; c a moving average (gamma) of the clients' c_i"
    Params = MoSWAParams
    server_state = {SERVER_VARIATE: init.zeros}
    sends = (SERVER_VARIATE,)
    keeps = (CLIENT_VARIATE,)

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        return Direction(grad.add_(ctx.server[SERVER_VARIATE] - cohort.state[CLIENT_VARIATE]),
                         ctx.settings.weight_decay)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        r""":math:`c_i^+ = c_i - c + (w^t - w_{i,E}) / (E_i \bar{\eta})`, :math:`\bar{\eta} = s\, \eta_l (1 + \rho) / 2`."""
        c = ctx.server[SERVER_VARIATE]
        mean_lr = self.p.scale * ctx.lr * (1 + self.p.rho) / 2
        c_plus = cohort.state[CLIENT_VARIATE] - c + (ctx.w_start - W) / (cohort.steps.to(W.dtype)[:, None] * mean_lr)
        cohort.new_state[CLIENT_VARIATE] = c_plus
        cohort.upload[VARIATE_GAP] = c_plus - c

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        r""":math:`c \leftarrow c + \gamma \frac{1}{K} \sum_{i \in S} (c_i^+ - c)` (:math:`\gamma = 1` in round 0)."""
        gamma = 1.0 if ctx.round == 0 else self.p.gamma
        ctx.server[SERVER_VARIATE] = ctx.server[SERVER_VARIATE] + gamma * ctx.uploads[VARIATE_GAP].mean(0)


SOURCE = "Liu et al., ICML 2025 (arXiv 2507.20016; github.com/junkangLiu0/FedSWA)"
register_recipe(Recipe(
    name="fedswa", display="FedSWA", summary="FedSWA: local SGD at a rate decaying linearly within each round, models averaged",
    source=SOURCE, correction="swa", tunable={"algo.rho": (0.0, 0.1, 0.5), "algo.scale": (1.0, 2.0)}))
register_recipe(Recipe(
    name="fedmoswa", display="FedMoSWA", summary="FedMoSWA: FedSWA's schedule with control variates, c a moving average of the c_i",
    source=SOURCE, correction="moswa", tunable={"algo.rho": (0.0, 0.1, 0.5), "algo.gamma": (0.2, 0.4, 1.0)}))
