r"""FedDyn (Acar et al., ICLR 2021): dynamic regularization aligns local and global stationary points.

Client dual :math:`h_i` (0 at first participation) and server :math:`h` (0), coefficient :math:`\alpha`.
Local direction :math:`g(w) - h_i + \alpha (w - w^t)`; after training :math:`h_i \leftarrow h_i - \alpha (w_{i,E} - w^t)`.
Server

.. math::

    h \leftarrow h - \alpha \frac{1}{N} \sum_{i \in S} (w_{i,E} - w^t), \qquad
    w^{t+1} = \frac{1}{K} \sum_{i \in S} w_{i,E} - \frac{h}{\alpha} .

The ``dyn`` correction owns both duals (:math:`h` is the running mean of the :math:`h_i`, as SCAFFOLD's :math:`c`
is of the :math:`c_i`); the ``dyn`` server reads :math:`h` from ``ctx.server`` and so requires the correction.
"""
from __future__ import annotations

import torch
from fedflat.core import (ClientContext, Cohort, Correction, Direction, PartParams, Recipe, RoundContext, ServerUpdate,
                          init, register_recipe, shared)

SERVER_DUAL = "dyn.h"  # server state: h
CLIENT_DUAL = "dyn.h_i"  # client state: h_i


def feddyn_client_dual(h_i: torch.Tensor, alpha: float, w_start: torch.Tensor, w_final: torch.Tensor) -> torch.Tensor:
    r""":math:`h_i \leftarrow h_i - \alpha (w_{i,E} - w^t)` (FedDyn Algorithm 1), row by row."""
    return h_i - alpha * (w_final - w_start)


def feddyn_server_dual(h: torch.Tensor, alpha: float, sum_delta: torch.Tensor, num_clients: int) -> torch.Tensor:
    r""":math:`h \leftarrow h - \alpha \frac{1}{N} \sum_{i \in S} (w_{i,E} - w^t)` (``sum_delta`` the sum over the sampled clients)."""
    return h - alpha * sum_delta / num_clients


class DynParams(PartParams):
    alpha: float = shared(0.1, gt=0, description="FedDyn regularization coefficient alpha (one value on the clients "
                                                 "and the server)")


class DynCorrection(Correction):
    r""":math:`d = g - h_i + \alpha (w - w^t)`; keeps :math:`h_i` per client and :math:`h` on the server."""

    name = "dyn"
    summary = "FedDyn: grad - h_i + alpha (w - w^t), client dual h_i and server dual h"
    Params = DynParams
    server_state = {SERVER_DUAL: init.zeros}
    keeps = (CLIENT_DUAL,)

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        r""":math:`\big(g - (h_i + \alpha w^t),\ \lambda_{wd} + \alpha\big)`: FL-Simulator's FedDyn, FedSMOO and FedSpeed put
        :math:`\langle w, -h_i - \alpha w^t \rangle` in the loss and :math:`\alpha` in SGD's weight decay (``client/feddyn.py:10``,
        ``fedsmoo.py:12``, ``fedspeed.py:12``); the pull is formed once per chunk."""
        own = cohort.own(self)
        if "pull" not in own:
            own["pull"] = torch.add(cohort.state[CLIENT_DUAL], ctx.w_start, alpha=self.p.alpha)
        return Direction(grad.sub_(own["pull"]), ctx.settings.weight_decay + self.p.alpha)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        cohort.new_state[CLIENT_DUAL] = feddyn_client_dual(cohort.state[CLIENT_DUAL], self.p.alpha, ctx.w_start, W)

    def finish(self, ctx: RoundContext) -> None:
        # Before the server step, which uses the new h; from the uploaded models, nothing else.
        ctx.server[SERVER_DUAL] = feddyn_server_dual(ctx.server[SERVER_DUAL], self.p.alpha,
                                                     (ctx.w_final - ctx.w_start).sum(0), ctx.settings.num_clients)


class DynServer(ServerUpdate):
    r""":math:`w^{t+1} = w^t + \eta_g \sum_i p_i \Delta_i - h / \alpha` (with :math:`\eta_g = 1` and uniform :math:`p_i`,
    FedDyn's :math:`\frac{1}{K} \sum_{i \in S} w_{i,E} - h / \alpha`)."""

    name = "dyn"
    summary = "FedDyn: w <- mean_i w_{i,E} - h / alpha"
    Params = DynParams
    requires = frozenset({SERVER_DUAL})

    def step(self, ctx: RoundContext) -> torch.Tensor:
        return ctx.w + ctx.settings.global_lr * ctx.aggregate(ctx.deltas) - ctx.server[SERVER_DUAL] / self.p.alpha


register_recipe(Recipe(
    name="feddyn", display="FedDyn",
    summary="dynamic regularization: client dual h_i, server dual h, w <- mean w_i - h/alpha",
    source="Acar et al., ICLR 2021", correction="dyn", server="dyn", defaults={"alpha": 0.1},
    tunable={"algo.alpha": (0.1, 0.01, 0.001)}))
