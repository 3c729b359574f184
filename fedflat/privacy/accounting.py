"""Privacy accounting of client-level DP with Google's dp-accounting library (RDP, and PLD for Poisson sampling).

Why dp-accounting: it is the accountant TensorFlow Privacy and TensorFlow Federated use, maintained by Google's
differential privacy team, and it accounts for *both* ways fedflat samples clients — Poisson sampling (each client
with probability ``q``, add/remove-one adjacency: one client's clipped release moves the sum by at most ``C``) and
fixed-size sampling without replacement (``K`` of ``N``, replace-one adjacency: one client's release replaced by
another's moves the sum by up to ``2C``, so the Gaussian's multiplier relative to that sensitivity is ``z / 2``;
Wang, Balle & Kasiviswanathan, AISTATS 2019, Theorem 27). Opacus's accountants cover Poisson sampling only.

One round of central DP is the event ``PoissonSampled(q, Gaussian(z))`` or ``SampledWithoutReplacement(N, K,
Gaussian(z / 2))``; ``T`` rounds compose it ``T`` times. Local DP releases each client's own noised update: client
``i`` that took part ``n_i`` times has spent a Gaussian mechanism of noise ``z C`` and sensitivity ``2C`` (replace-one:
any two data sets of one client give releases at most ``2C`` apart) composed ``n_i`` times, which is exactly one
Gaussian mechanism of noise multiplier ``z / (2 sqrt(n_i))`` relative to its sensitivity; the run reports the largest
over its clients. dp-accounting's two accountants read a ``GaussianDpEvent`` differently: its RDP accountant takes its
multiplier relative to a sensitivity of 1 whatever the adjacency (the event is ``Gaussian(z / 2)``), its PLD
accountant under replace-one takes the pair ``N(-1, s^2), N(1, s^2)``, the sensitivity 2 already in it (the event is
``Gaussian(z)``; ``Gaussian(z / 2)`` there would count the ``2C`` twice).

RDP composes linearly, so the accountant works out one round's RDP curve once and converts ``t`` times it at every
round (the same arithmetic as composing ``SelfComposedDpEvent(event, t)``).

A run's privacy ledger (:class:`PrivacyLedger`): what its accountant has spent, round by round, and its budget. Central
DP spends one round's mechanism per round, whoever took part (Poisson sampling hides who did): after round ``t`` the run
has spent ``epsilon(t + 1)``. Local DP spends per client: a client that released ``n_i`` times has spent
``epsilon(n_i)``, and the run reports its largest client. Instance-level DP (DP-SGD) spends per local step of each
client: the run reports the bound over its clients, ``epsilon`` of the most steps any client took at the sampling rate
of the smallest client. The ledger's state (each client's count) is checkpointed with the run, so a resumed run
continues the accountant exactly. The ledger holds the run's tensors but imports no torch.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fedflat.core.errors import BudgetSpent

if TYPE_CHECKING:
    import torch

Sampling = Literal["poisson", "fixed"]

# DP-SGD's steps sample B of a client's n examples without replacement under replace-one adjacency: dp-accounting's
# PLD accountant has no event for it (its RDP accountant does: Wang, Balle & Kasiviswanathan 2019, Theorem 27), and
# no pair of its events is known to dominate it under composition, so fedflat does not substitute one
INSTANCE_PLD = ("privacy.accountant=pld with privacy.level=instance: DP-SGD samples each step's batch without "
                "replacement, which dp-accounting's PLD accountant cannot account; use privacy.accountant=rdp")
# PLD's grid: dp-accounting's PLD of a Gaussian of noise multiplier s (noise std over sensitivity) holds about
# 2e5 / s points at its 1e-4 discretization; below s = 0.25 one evaluation takes millions of points and seconds to
# minutes, and a calibration a dozen of them. (At s = 0.25 one round already spends epsilon near 20.)
PLD_SMALLEST_MULTIPLIER = 0.25


@functools.cache
def _dpa() -> Any:
    """dp-accounting, imported on first use (with SciPy's signal processing it takes seconds: a run without
    privacy never pays it)."""
    import dp_accounting

    # dp-accounting logs (through absl) every RDP order whose series does not converge, tens of lines a call, and
    # leaves those orders out of the minimum; fedflat says it once, where it matters (:func:`unconverged_orders`)
    logging.getLogger("absl").setLevel(logging.ERROR)
    return dp_accounting


@dataclass(frozen=True)
class Mechanism:
    """What one round releases: the ``sampling`` (``fixed``: ``clients_per_round`` ``K`` of ``num_clients`` ``N``;
    ``poisson``: each with ``q = K / N``), the ``noise_multiplier`` ``z`` (noise std ``z C``) and the ``mode``, where
    it is added (``central``: on the sum; ``local``: by each client), accounted by ``accountant`` (``rdp`` or
    ``pld``). At the instance ``level`` (DP-SGD on each client) a step samples ``batch_size`` of a client's
    ``dataset_size`` examples and releases ``gradients`` noised gradients of that batch."""

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
        if self.mode == "local":  # sensitivity 2C: PLD's replace-one pair has it, RDP's Gaussian does not (docstring)
            return dpa.GaussianDpEvent(z if self.accountant == "pld" else z / 2)
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
            if self.level == "instance":
                raise ValueError(INSTANCE_PLD)
            if self.neighboring != dpa.NeighboringRelation.ADD_OR_REMOVE_ONE and self.mode != "local":
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
    eps, best = rdp_privacy_accountant.compute_epsilon(list(orders), [rounds * r for r in rdp], delta)
    skipped = unconverged_orders(mechanism)
    if skipped and best is not None and best <= min(o for o, r in zip(orders, rdp) if math.isfinite(r)):
        _warn_conservative(mechanism, skipped, float(best))
    return float(eps)


@functools.lru_cache(maxsize=64)
def unconverged_orders(mechanism: Mechanism) -> tuple[float, ...]:
    """The RDP orders at which dp-accounting's series for one round does not converge (its fractional-order series
    of the sampled Gaussian, Mironov, Talwar and Zhang 2019, Sec. 3.3, stops after a fixed number of terms, for
    orders below about 1.7 when ``q`` is large). dp-accounting leaves them out of the minimum over orders: the
    epsilon stays a valid bound, conservative where the best order would be among them (large epsilon)."""
    orders, rdp = _round_rdp(mechanism)
    return tuple(o for o, r in zip(orders, rdp) if not math.isfinite(r))


@functools.lru_cache(maxsize=64)
def _warn_conservative(mechanism: Mechanism, skipped: tuple[float, ...], best: float) -> None:
    logging.getLogger(__name__).warning(
        "privacy: dp-accounting's RDP series does not converge at orders %s (q = %g, z = %g) and leaves them out; "
        "the best remaining order, %g, is the smallest, so epsilon is conservative (a lower order could give less). "
        "privacy.accountant=pld (Poisson sampling) computes it tightly", ", ".join(f"{o:g}" for o in skipped),
        mechanism.q, mechanism.noise_multiplier, best)


@functools.lru_cache(maxsize=64)
def calibrate(mechanism: Mechanism, rounds: int, delta: float, target_epsilon: float) -> float:
    """The smallest noise multiplier ``z`` whose ``rounds`` rounds spend at most ``target_epsilon`` at ``delta``
    (dp-accounting's ``calibrate_dp_mechanism``, Brent's method to a tolerance of 1e-4 in ``z``, then the bracket's
    private end: the returned ``z`` never spends more than the target). Under local DP ``rounds`` is the most
    releases of one client.

    RDP searches ``z`` in ``[1e-3, 1e3]`` (seconds). PLD cannot start there: at ``z = 1e-3`` the privacy loss
    distribution's grid has tens of GiB, so its bracket comes from RDP and stays where PLD's grid is small
    (:func:`pld_bracket`); a target that PLD reaches only with less noise is refused in seconds, saying so."""
    from dataclasses import replace

    dpa = _dpa()

    def event(z: float) -> Any:
        return dpa.SelfComposedDpEvent(replace(mechanism, noise_multiplier=z).round_event(), rounds)

    bracket = (1e-3, 1e3) if mechanism.accountant == "rdp" else pld_bracket(mechanism, rounds, delta, target_epsilon)
    z = dpa.calibrate_dp_mechanism(mechanism.fresh, event, target_epsilon, delta,
                                   dpa.ExplicitBracketInterval(*bracket), tol=1e-4)
    return float(z)


def pld_smallest_noise(mechanism: Mechanism, rounds: int) -> float:
    """The smallest ``z`` PLD calibrates to: the one whose Gaussian, as dp-accounting's PLD builds it, has noise
    multiplier :data:`PLD_SMALLEST_MULTIPLIER` relative to its sensitivity (``z`` itself under Poisson sampling, one
    round at a time; ``z / (2 sqrt(rounds))`` under local DP, whose ``rounds`` Gaussians compose into one)."""
    return PLD_SMALLEST_MULTIPLIER * (2 * rounds ** 0.5 if mechanism.mode == "local" else 1.0)


def pld_bracket(mechanism: Mechanism, rounds: int, delta: float, target_epsilon: float) -> tuple[float, float]:
    """``(z_lo, z_hi)`` with PLD's epsilon above the target at ``z_lo`` and at most the target at ``z_hi``, both
    near the answer and at least :func:`pld_smallest_noise`, where PLD's grid stays small (megabytes, seconds an
    evaluation). ``z_hi`` starts at RDP's calibration (RDP bounds the same mechanism less tightly, so PLD spends less
    there; doubled until it does), ``z_lo`` at 0.8 of it (lowered by that factor while PLD still spends at most the
    target, at most 10 times: down to a tenth of RDP's ``z``). A target reached only below the smallest ``z`` is
    refused (``ValueError``): at most a few PLD evaluations, each on a small grid, run before the answer."""
    from dataclasses import replace

    def spent(z: float) -> float:
        return epsilon(replace(mechanism, noise_multiplier=z), rounds, delta)

    smallest = pld_smallest_noise(mechanism, rounds)
    z_hi = calibrate(replace(mechanism, accountant="rdp"), rounds, delta, target_epsilon)
    if z_hi < smallest:  # PLD, the tighter accountant, would need less noise still
        raise ValueError(_too_little_noise(mechanism, rounds, target_epsilon, smallest))
    for _ in range(6):
        if spent(z_hi) <= target_epsilon:
            break
        z_hi *= 2
    for _ in range(10):
        z_lo = max(0.8 * z_hi, smallest)
        if spent(z_lo) > target_epsilon:
            return z_lo, z_hi
        if z_lo == smallest:
            raise ValueError(_too_little_noise(mechanism, rounds, target_epsilon, smallest))
        z_hi = z_lo
    raise ValueError(f"privacy.target_epsilon={target_epsilon}: the PLD accountant spends less than that even at "
                     f"z = {z_lo:.3g}; raise the rounds or lower the target, or use privacy.accountant=rdp")


def _too_little_noise(mechanism: Mechanism, rounds: int, target_epsilon: float, smallest: float) -> str:
    releases = "release(s) of one client" if mechanism.mode == "local" else "round(s)"
    return (f"privacy.target_epsilon={target_epsilon:g} over {rounds} {releases}: the PLD accountant reaches it only "
            f"with z below {smallest:.3g} (noise under {PLD_SMALLEST_MULTIPLIER} of the sensitivity), where its "
            "privacy-loss grid takes millions of points and a calibration many minutes; use privacy.accountant=rdp "
            "(seconds), or a smaller privacy.target_epsilon")


@dataclass
class PrivacyLedger:
    """A run's spending and its budget (module docstring); the engine's server makes a run's from its config:
    ``mechanism`` is what a round releases, ``delta`` the delta of (epsilon, delta), ``budget`` the
    ``privacy.target_epsilon`` no round may go beyond, ``participations`` each client's releases (local DP) or local
    steps (instance level)."""

    mechanism: Mechanism
    delta: float
    budget: float | None  # privacy.target_epsilon: no round may take the run beyond it
    participations: torch.Tensor  # [N]: each client's releases (local DP) or local steps (instance level)

    def epsilon_after(self, round: int, sampled: torch.Tensor, steps: torch.Tensor | None = None) -> float:
        """The run's epsilon once round ``round`` (0-based) has released, with ``sampled`` its clients (and
        ``steps`` their local steps, at the instance level)."""
        m = self.mechanism
        if m.level == "client" and m.mode == "central":
            return epsilon(m, round + 1, self.delta)
        counts = self.participations.clone()
        counts[sampled] += 1 if m.level == "client" else steps.to(counts.dtype)
        return epsilon(m, int(counts.max()), self.delta)

    def check_budget(self, round: int, sampled: torch.Tensor, steps: torch.Tensor) -> None:
        """Refuses round ``round`` (0-based), releasing the clients ``sampled`` (with ``steps`` local steps each, at
        the instance level), when it would take the run beyond its budget (:class:`BudgetSpent`)."""
        if self.budget is None:
            return
        after = self.epsilon_after(round, sampled, steps)
        if after > self.budget * (1 + 1e-9):
            spent = self.epsilon_after(round - 1, sampled[:0], steps[:0]) if round else 0.0
            raise BudgetSpent(f"privacy budget spent: round {round + 1} would reach epsilon {after:.4g} > "
                              f"privacy.target_epsilon {self.budget:g} (spent {spent:.4g} at delta {self.delta:g})")

    def spend(self, round: int, ids: torch.Tensor, steps: torch.Tensor) -> dict[str, float]:
        """Records round ``round`` with its releasing clients ``ids`` (and their local ``steps``); the round's
        privacy line."""
        value = self.epsilon_after(round, ids, steps)
        self.participations[ids] += 1 if self.mechanism.level == "client" else steps.to(self.participations.dtype)
        return {"epsilon": value}

    def describe(self) -> dict[str, object]:
        """What summary.json says of the accounting."""
        m = self.mechanism
        return {"level": m.level, "mode": m.mode, "accountant": m.accountant, "sampling": m.describe(), "noise_multiplier": m.noise_multiplier,
                "sampling_rate": m.q, "delta": self.delta, "target_epsilon": self.budget}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"participations": self.participations.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The participations so far, from a checkpoint's ``state`` (:meth:`state_dict`)."""
        self.participations = state["participations"].clone()
