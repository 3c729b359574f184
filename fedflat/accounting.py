"""Privacy accounting of client-level DP with Google's dp-accounting library (RDP, and PLD for Poisson sampling).

Why dp-accounting: it is the accountant TensorFlow Privacy and TensorFlow Federated use, maintained by Google's
differential privacy team, and it accounts for *both* ways fedflat samples clients — Poisson sampling (each client
with probability ``q``, add/remove-one adjacency: one client's clipped release moves the sum by at most ``C``) and
fixed-size sampling without replacement (``K`` of ``N``, replace-one adjacency: one client's release replaced by
another's moves the sum by up to ``2C``, so the Gaussian's multiplier relative to that sensitivity is ``z / 2``;
Wang, Balle & Kasiviswanathan, AISTATS 2019, Theorem 27). Opacus's accountants cover Poisson sampling only.

One round of central DP is the event ``PoissonSampled(q, Gaussian(z))`` or ``SampledWithoutReplacement(N, K,
Gaussian(z / 2))``; ``T`` rounds compose it ``T`` times. Local DP releases each client's own noised update: client
``i`` that took part ``n_i`` times has spent ``Gaussian(z / 2)`` composed ``n_i`` times (replace-one: any two data
sets of one client give releases at most ``2C`` apart), and the run reports the largest over its clients.

RDP composes linearly, so the accountant works out one round's RDP curve once and converts ``t`` times it at every
round (the same arithmetic as composing ``SelfComposedDpEvent(event, t)``).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Literal

Sampling = Literal["poisson", "fixed"]


@functools.cache
def _dpa() -> Any:
    """dp-accounting, imported on first use (with SciPy's signal processing it takes seconds: a run without
    privacy never pays it)."""
    import dp_accounting

    # dp-accounting logs (through absl) every RDP order whose series does not converge, tens of lines a call: the
    # orders are left out of the minimum, which is what we want, so the lines say nothing to a user
    logging.getLogger("absl").setLevel(logging.ERROR)
    return dp_accounting


@dataclass(frozen=True)
class Mechanism:
    """What one round releases: the sampling (``N`` clients, ``K`` per round or each with ``q = K / N``), the noise
    multiplier ``z`` (noise std ``z C``) and where it is added (``central``: on the sum; ``local``: by each client)."""

    sampling: Sampling
    num_clients: int
    clients_per_round: int
    noise_multiplier: float
    mode: Literal["central", "local"] = "central"
    accountant: Literal["rdp", "pld"] = "rdp"
    # instance level (DP-SGD on each client): a step samples `batch_size` of a client's `dataset_size` examples
    # without replacement and releases `gradients` noised gradients of that batch (SAM's ascent and descent: 2)
    level: Literal["client", "instance"] = "client"
    dataset_size: int = 0
    batch_size: int = 0
    gradients: int = 1

    @property
    def q(self) -> float:
        return self.clients_per_round / self.num_clients

    @property
    def neighboring(self) -> Any:
        dpa = _dpa()
        central_poisson = self.level == "client" and self.mode == "central" and self.sampling == "poisson"
        return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if central_poisson else dpa.NeighboringRelation.REPLACE_ONE

    def round_event(self) -> Any:
        """One round's DP event (module docstring)."""
        dpa, z = _dpa(), self.noise_multiplier
        if self.level == "instance":  # g Gaussians of multiplier z/2 on one batch: one of z/(2 sqrt(g)), exactly
            return dpa.SampledWithoutReplacementDpEvent(self.dataset_size, min(self.batch_size, self.dataset_size),
                                                        dpa.GaussianDpEvent(z / (2 * self.gradients ** 0.5)))
        if self.mode == "local":
            return dpa.GaussianDpEvent(z / 2)
        if self.sampling == "poisson":
            return dpa.PoissonSampledDpEvent(self.q, dpa.GaussianDpEvent(z))
        return dpa.SampledWithoutReplacementDpEvent(self.num_clients, self.clients_per_round, dpa.GaussianDpEvent(z / 2))

    def describe(self) -> str:
        """The sampling and adjacency the accountant assumes, for the run's files."""
        if self.level == "instance":
            return (f"instance level (DP-SGD): each step samples {self.batch_size} of a client's examples without "
                    f"replacement, bounded by the smallest client ({self.dataset_size} examples), {self.gradients} "
                    "noised gradient(s) of the batch a step, replace-one adjacency (sensitivity 2C)")
        if self.mode == "local":
            return "local DP: each client's release is a Gaussian mechanism, replace-one adjacency (sensitivity 2C)"
        if self.sampling == "poisson":
            return f"Poisson sampling of clients (q = {self.q:g}), add/remove-one adjacency (sensitivity C)"
        return (f"fixed-size sampling without replacement ({self.clients_per_round} of {self.num_clients}), "
                "replace-one adjacency (sensitivity 2C)")

    def fresh(self) -> Any:
        from dp_accounting.pld import PLDAccountant
        from dp_accounting.rdp import RdpAccountant

        dpa = _dpa()
        if self.accountant == "pld":
            if self.neighboring != dpa.NeighboringRelation.ADD_OR_REMOVE_ONE and self.mode != "local" \
                    and self.level == "client":
                raise ValueError("privacy.accountant=pld accounts Poisson sampling (sampling.participation="
                                 "bernoulli); fixed-size sampling needs accountant=rdp")
            return PLDAccountant(neighboring_relation=self.neighboring)
        return RdpAccountant(neighboring_relation=self.neighboring)


@functools.lru_cache(maxsize=64)
def _round_rdp(mechanism: Mechanism) -> tuple[tuple[float, ...], tuple[float, ...]]:
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(neighboring_relation=mechanism.neighboring)
    accountant.compose(mechanism.round_event())
    return tuple(accountant._orders), tuple(accountant._rdp)


def epsilon(mechanism: Mechanism, rounds: int, delta: float) -> float:
    """``epsilon`` at ``delta`` after ``rounds`` rounds of ``mechanism`` (0 before any; ``inf`` without noise)."""
    if rounds <= 0:
        return 0.0
    if mechanism.noise_multiplier == 0:
        return float("inf")
    if mechanism.accountant == "pld":
        accountant = mechanism.fresh()
        accountant.compose(mechanism.round_event(), rounds)
        return float(accountant.get_epsilon(delta))
    from dp_accounting.rdp import rdp_privacy_accountant

    orders, rdp = _round_rdp(mechanism)
    eps, _ = rdp_privacy_accountant.compute_epsilon(list(orders), [rounds * r for r in rdp], delta)
    return float(eps)


@functools.lru_cache(maxsize=64)
def calibrate(mechanism: Mechanism, rounds: int, delta: float, target_epsilon: float) -> float:
    """The smallest noise multiplier ``z`` whose ``rounds`` rounds spend at most ``target_epsilon`` at ``delta``
    (dp-accounting's ``calibrate_dp_mechanism``, Brent's method to a tolerance of 1e-4 in ``z``, then the bracket's
    private end: the returned ``z`` never spends more than the target)."""
    from dataclasses import replace

    dpa = _dpa()

    def event(z: float) -> Any:
        return dpa.SelfComposedDpEvent(replace(mechanism, noise_multiplier=z).round_event(), rounds)

    z = dpa.calibrate_dp_mechanism(mechanism.fresh, event, target_epsilon, delta,
                                   dpa.ExplicitBracketInterval(1e-3, 1e3), tol=1e-4)
    return float(z)

