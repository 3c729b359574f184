"""From a config's ``privacy`` section to what a run uses: the mechanism the accountant composes each round, the
``delta``, the noise multiplier (given, or calibrated to ``target_epsilon`` before round 0) and the upload path's
``dp`` stage (:class:`fedflat.privacy.stage.GaussianMechanism`)."""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from fedflat.privacy.accounting import Mechanism, calibrate
from fedflat.privacy.config import PrivacyConfig


def client_mechanism(privacy: PrivacyConfig | None, num_clients: int, clients_per_round: int,
                     participation: str) -> Mechanism | None:
    """The client-level mechanism one round of ``privacy`` (the config's section) releases (None without
    client-level DP): Poisson sampling under ``participation`` (``sampling.participation``) ``bernoulli``, else
    ``clients_per_round`` ``K`` of ``num_clients`` ``N`` without replacement; ``z = 1`` stands in for a multiplier
    still to be calibrated."""
    if privacy is None or privacy.level != "client":
        return None
    sampling = "poisson" if participation == "bernoulli" else "fixed"
    return Mechanism(sampling, num_clients, clients_per_round,
                     privacy.noise_multiplier if privacy.noise_multiplier is not None else 1.0, privacy.mode,
                     privacy.accountant)


def delta_of(privacy: PrivacyConfig, population: int) -> float:
    """``delta`` of (epsilon, delta): the one ``privacy`` (the config's section) gives, else ``1 / population``
    (the clients ``N`` at the client level, every client's examples at the instance level)."""
    return privacy.delta if privacy.delta is not None else 1.0 / population


def calibrated_noise(privacy: PrivacyConfig, mechanism: Mechanism | None, rounds: int, delta: float,
                     seed: int) -> float | None:
    """``z``: the given one, or the smallest whose run spends at most ``target_epsilon`` at ``delta``
    (:func:`fedflat.privacy.accounting.calibrate`): central DP spends one round's ``mechanism`` each of the
    ``rounds`` rounds; local DP spends per release of a client, and the run reports its most-sampled client, so ``z``
    is calibrated to the most releases of one client in the run's own sampling of ``rounds`` rounds from ``seed``
    (:func:`most_releases`), not to ``rounds``: exact, where ``rounds`` would add noise for releases that never
    happen (``sqrt(rounds / most)`` times the noise, about, under partial participation)."""
    if privacy.noise_multiplier is not None or privacy.level != "client":
        return privacy.noise_multiplier
    if privacy.mode == "local":
        rounds = most_releases(mechanism, rounds, seed)
    return calibrate(replace(mechanism, noise_multiplier=1.0), rounds, delta, privacy.target_epsilon)


@functools.lru_cache(maxsize=16)  # (the config asks for z more than once; a schedule is rounds x N draws)
def most_releases(mechanism: Mechanism, rounds: int, seed: int) -> int:
    """The most rounds one client takes part in over ``rounds`` rounds of the run's client sampling
    (:func:`fedflat.core.round.sample_clients` from ``seed``: data-independent and public in the analysis, so the
    noise may depend on it), at least 1."""
    from fedflat.core.round import sample_clients  # (torch: a calibration's cost, not the config's)

    counts = [0] * mechanism.num_clients
    participation = "bernoulli" if mechanism.sampling == "poisson" else "uniform"
    for t in range(rounds):
        for i in sample_clients(seed, t, mechanism.num_clients, mechanism.clients_per_round, participation,
                                at_least_one=False):
            counts[i] += 1
    return max(1, max(counts))


def dp_stage(privacy: PrivacyConfig, clients_per_round: int, noise_multiplier: float) -> dict[str, Any]:
    """The upload path's ``dp`` stage for client-level DP under ``privacy`` (the config's section),
    ``{name: dp, **hyperparameters}`` (:class:`fedflat.privacy.stage.GaussianParams`) with ``noise_multiplier``
    ``z``; the central mean's denominator is the expected number of clients per round, ``clients_per_round``
    ``K`` (or ``q N = K`` under Poisson sampling)."""
    return {"name": "dp", "mode": privacy.mode, "clip": privacy.clip, "noise_multiplier": noise_multiplier,
            "expected_clients": float(clients_per_round), "adaptive": privacy.adaptive, "quantile": privacy.quantile,
            "clip_lr": privacy.clip_lr, "count_noise": privacy.count_noise, "secure": privacy.noise == "secure"}
