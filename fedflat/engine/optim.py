"""Local optimizers and per-round learning-rate schedules (``train.optimizer``, ``train.schedule``).

A local step's direction ``d[C, P]`` is what the parts compute (the gradient with the method's terms, weight decay
and clip: :func:`fedflat.engine.client.local_direction`), the tensor ``torch.optim`` finds in ``p.grad``; the
optimizer turns it into the step, row by row, with ``torch.optim``'s arithmetic:

- SGD (``torch.optim.SGD``): ``b <- mu b + (1 - tau) d`` (``b = d`` at the first step), ``d <- d + mu b``
  (Nesterov) or ``d <- b``; ``w <- w - eta d``. ``momentum: 0`` is plain SGD, every method's own step.
- Adam (``torch.optim.Adam``): ``m <- beta1 m + (1 - beta1) d``, ``v <- beta2 v + (1 - beta2) d^2``,
  ``w <- w - eta / (1 - beta1^s) m / (sqrt(v) / sqrt(1 - beta2^s) + eps)`` at its ``s``-th step; the weight
  decay is coupled (in ``d``).
- AdamW (``torch.optim.AdamW``): ``w <- w (1 - eta wd)`` first, then Adam on ``d`` without the weight decay.

The state (``b``; ``m``, ``v``, ``s``) is fresh every round by default, as the methods' public codes build their
optimizer in every client's round; ``optimizer_state: client`` keeps each client's in the client-state store
(:data:`STATE_KEYS`), so checkpoints, Ray workers and Flower nodes carry it as they carry SCAFFOLD's ``c_i``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import cos, pi

import torch

from fedflat.core import ConfigError, LocalOptimizer

MOMENTUM_BUFFER = "optim.momentum"  # SGD's b, [C, P]
EXP_AVG = "optim.exp_avg"  # Adam's m, [C, P]
EXP_AVG_SQ = "optim.exp_avg_sq"  # Adam's v, [C, P]
STEP = "optim.step"  # Adam's step count s, [C, 1] float64
STATE_KEYS = {"sgd": (MOMENTUM_BUFFER,), "adam": (EXP_AVG, EXP_AVG_SQ, STEP), "adamw": (EXP_AVG, EXP_AVG_SQ, STEP)}

# Parts whose equations divide a round's model change by eta_l (or use eta_l as a step size), which holds for
# plain SGD steps only: (role, part name) -> why.
PLAIN_SGD_PARTS = {
    ("correction", "scaffold"): "its control variate c_i+ = c_i - c + (w - y_i) / (E eta_l) is the mean gradient "
                                "only when every local step is w - eta_l d",
    ("correction", "wmsam"): "SCAFFOLD's control variate c_i+ = c_i - c + (w - y_i) / (E eta_l) is the mean gradient "
                             "only when every local step is w - eta_l d",
    ("correction", "momentum"): "its momentum m is the round's average update -Delta_i / (E eta_l), a gradient only "
                                "when every local step is w - eta_l d",
    ("correction", "vssam"): "it mixes the server's gradient-scale direction -Delta / (E eta_l) into every step, a "
                             "gradient only under plain SGD steps",
    ("perturbation", "wmsam"): "its momentum-guided point moves by eta_l times the momentum, a plain SGD step",
    ("server", "vssam"): "its global direction (w - y) / (E eta_l) is the mean gradient only under plain SGD steps",
    ("server", "qfedavg"): "its Lipschitz estimate L = 1/eta_l is that of plain SGD steps",
    ("correction", "swa"): "its within-round schedule scales the plain SGD step's rate",
    ("correction", "moswa"): "its within-round schedule scales the plain SGD step's rate, and its c_i divides the "
                             "round's change by the mean rate",
}
# Parts that read the exponential schedule's factor lr_decay (FedWMSAM's server momentum m = lr_decay Gbar)
EXPONENTIAL_PARTS = {("correction", "wmsam"): "its server momentum m = lr_decay Gbar follows the authors' "
                                              "exponential scheduler"}


def optimizer_of(train) -> LocalOptimizer:
    """The :class:`~fedflat.core.LocalOptimizer` of a config's ``train`` section."""
    return LocalOptimizer(name=train.optimizer, momentum=train.momentum, dampening=train.dampening,
                          nesterov=train.nesterov, betas=tuple(train.betas), eps=train.eps, keep=train.optimizer_state)


def state_widths(optimizer: LocalOptimizer) -> dict[str, tuple[int, torch.dtype]]:
    """Client-store entries whose width is not ``P``: Adam's step count (one float64 per client)."""
    return {STEP: (1, torch.float64)} if optimizer.name != "sgd" else {}


def state_vectors(optimizer: LocalOptimizer) -> int:
    """Model-sized vectors per client a cohort's optimizer holds during a step (its state, and the state's previous
    values where rows are masked): the vectorized engine's memory estimate."""
    return 0 if optimizer.plain else 2 * (1 if optimizer.name == "sgd" else 2)


def state_keys(optimizer: LocalOptimizer) -> list[str]:
    """The client-state names the optimizer keeps per client (none unless ``keep == "client"``)."""
    if optimizer.keep != "client" or optimizer.plain:
        return []
    return list(STATE_KEYS[optimizer.name])


def check_recipe(parts: dict, algorithm: str, optimizer: LocalOptimizer, schedule: str) -> None:
    """Refuses, with the reason, a method whose equations assume what the chosen optimizer or schedule changes."""
    for role, part in parts.items():
        why = PLAIN_SGD_PARTS.get((role, part.name))
        if why is not None and not optimizer.plain:
            raise ConfigError(f"algo={algorithm} needs plain local SGD steps ({role} '{part.name}': {why}); "
                              f"use train.optimizer=sgd train.momentum=0")
        why = EXPONENTIAL_PARTS.get((role, part.name))
        if why is not None and schedule != "exponential":
            raise ConfigError(f"algo={algorithm} needs train.schedule=exponential ({role} '{part.name}': {why})")


def round_lr(train, round: int, rounds: int) -> float:
    """``eta_l^t`` of round ``t`` (0-based) of ``rounds``: a linear warm-up ``eta (t + 1) / T_w`` over the first
    ``warmup_rounds`` ``T_w``, then with ``t' = t - T_w`` and ``T' = rounds - T_w``:
    ``exponential`` ``eta gamma^t'`` (``gamma = lr_decay``; ``torch.optim.lr_scheduler.ExponentialLR``),
    ``step`` ``eta gamma^floor(t' / step_rounds)`` (``gamma = step_gamma``; ``StepLR``) or
    ``cosine`` ``eta_min + (eta - eta_min) (1 + cos(pi t' / T')) / 2`` (``CosineAnnealingLR``'s closed form)."""
    lr, warmup = train.lr, train.warmup_rounds
    if round < warmup:
        return lr * (round + 1) / warmup
    t = round - warmup
    if train.schedule == "exponential":
        return lr * train.lr_decay ** t
    if train.schedule == "step":
        return lr * train.step_gamma ** (t // train.step_rounds)
    span = max(1, rounds - warmup)
    return train.min_lr + (lr - train.min_lr) * (1 + cos(pi * t / span)) / 2


@dataclass
class OptimizerState:
    """One cohort's optimizer state for a round: rows ``[C, ...]``, started fresh or from the clients' kept rows.

    ``fresh[C]``: rows without a momentum buffer yet (SGD's first step copies ``d``)."""

    spec: LocalOptimizer
    tensors: dict[str, torch.Tensor]
    fresh: torch.Tensor

    @classmethod
    def start(cls, spec: LocalOptimizer, W: torch.Tensor, state: dict[str, torch.Tensor],
              known: dict[str, torch.Tensor]) -> "OptimizerState":
        """Fresh state for ``W[C, P]``'s rows, or each client's kept rows where it has some (``keep == "client"``)."""
        C = W.shape[0]
        kept = spec.keep == "client"
        names = STATE_KEYS[spec.name]
        fresh = ~known[names[0]].to(W.device) if kept else torch.ones(C, dtype=torch.bool, device=W.device)
        if spec.name == "sgd":
            tensors = {MOMENTUM_BUFFER: state[MOMENTUM_BUFFER].to(W).clone() if kept else torch.zeros_like(W)}
        else:
            tensors = {EXP_AVG: state[EXP_AVG].to(W).clone() if kept else torch.zeros_like(W),
                       EXP_AVG_SQ: state[EXP_AVG_SQ].to(W).clone() if kept else torch.zeros_like(W),
                       STEP: (state[STEP].to(W.device, torch.float64).clone() if kept else
                              torch.zeros(C, 1, dtype=torch.float64, device=W.device))}
        return cls(spec, tensors, fresh)

    def step(self, W: torch.Tensor, d: torch.Tensor, lr: float, decay: float,
             active: torch.Tensor | None) -> torch.Tensor:
        """``W`` after one step along ``d`` (``decay``: AdamW's decoupled weight decay); rows not ``active`` (their
        local steps are exhausted) keep their parameters and state."""
        old = None if active is None else {k: v.clone() for k, v in self.tensors.items()}
        new = self._sgd(W, d, lr) if self.spec.name == "sgd" else self._adam(W, d, lr, decay)
        if active is None:
            return new
        keep = active[:, None]
        for k, v in self.tensors.items():
            self.tensors[k] = torch.where(keep, v, old[k])
        return torch.where(keep, new, W)

    def _sgd(self, W: torch.Tensor, d: torch.Tensor, lr: float) -> torch.Tensor:
        """``torch.optim.SGD``'s step with momentum on every row."""
        s = self.spec
        b = self.tensors[MOMENTUM_BUFFER]
        b = torch.where(self.fresh[:, None], d, b.mul(s.momentum).add_(d, alpha=1 - s.dampening))
        self.tensors[MOMENTUM_BUFFER] = b
        self.fresh = torch.zeros_like(self.fresh)
        step = d.add(b, alpha=s.momentum) if s.nesterov else b
        return W.add(step, alpha=-lr)

    def _adam(self, W: torch.Tensor, d: torch.Tensor, lr: float, decay: float) -> torch.Tensor:
        """``torch.optim.Adam``'s (``AdamW``'s with ``decay``) step on every row, each at its own step count."""
        beta1, beta2 = self.spec.betas
        if decay:
            W = W.mul(1 - lr * decay)
        steps = self.tensors[STEP] + 1
        m = self.tensors[EXP_AVG].lerp(d, 1 - beta1)
        v = self.tensors[EXP_AVG_SQ].mul(beta2).addcmul_(d, d, value=1 - beta2)
        self.tensors.update({STEP: steps, EXP_AVG: m, EXP_AVG_SQ: v})
        step_size = (lr / (1 - beta1 ** steps)).to(W.dtype)  # [C, 1], in float64 as torch's Python scalars
        denom = (v.sqrt() / (1 - beta2 ** steps).sqrt().to(W.dtype)).add_(self.spec.eps)
        return W.addcdiv(m * -step_size, denom)

    def save(self, new_state: dict[str, torch.Tensor]) -> None:
        """The rows each client keeps (``keep == "client"``) into the cohort's new state."""
        if self.spec.keep == "client":
            new_state.update(self.tensors)

