"""From a config's ``privacy`` section to what a run uses: the mechanism the accountant composes each round, the
``delta``, the noise multiplier (given, or calibrated to ``target_epsilon`` before round 0) and the upload path's
``dp`` stage (:class:`fedflat.privacy.stage.GaussianMechanism`)."""
from __future__ import annotations

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


def calibrated_noise(privacy: PrivacyConfig, mechanism: Mechanism | None, rounds: int, delta: float) -> float | None:
    """``z``: the given one, or the smallest whose ``rounds`` rounds of ``mechanism`` spend at most
    ``target_epsilon`` at ``delta`` (:func:`fedflat.privacy.accounting.calibrate`)."""
    if privacy.noise_multiplier is not None or privacy.level != "client":
        return privacy.noise_multiplier
    return calibrate(replace(mechanism, noise_multiplier=1.0), rounds, delta, privacy.target_epsilon)


def dp_stage(privacy: PrivacyConfig, clients_per_round: int, noise_multiplier: float) -> dict[str, Any]:
    """The upload path's ``dp`` stage for client-level DP under ``privacy`` (the config's section),
    ``{name: dp, **hyperparameters}`` (:class:`fedflat.privacy.stage.GaussianParams`) with ``noise_multiplier``
    ``z``; the central mean's denominator is the expected number of clients per round, ``clients_per_round``
    ``K`` (or ``q N = K`` under Poisson sampling)."""
    return {"name": "dp", "mode": privacy.mode, "clip": privacy.clip, "noise_multiplier": noise_multiplier,
            "expected_clients": float(clients_per_round), "adaptive": privacy.adaptive, "quantile": privacy.quantile,
            "clip_lr": privacy.clip_lr, "count_noise": privacy.count_noise, "secure": privacy.noise == "secure"}
