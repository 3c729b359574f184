"""Differential privacy in one package, one public surface (``from fedflat.privacy import ...``):

- :mod:`~fedflat.privacy.config`: the config's ``privacy`` section (:class:`PrivacyConfig`) and what it refuses of a
  method's upload path (:func:`check_upload_path`);
- :mod:`~fedflat.privacy.calibration`: from that section to what a run uses: the mechanism the accountant composes
  (:func:`client_mechanism`), ``delta`` (:func:`delta_of`), the noise multiplier calibrated to a target epsilon
  (:func:`calibrated_noise`), the upload path's ``dp`` stage (:func:`dp_stage`);
- :mod:`~fedflat.privacy.accounting`: epsilon with Google's dp-accounting (:class:`Mechanism`, :func:`epsilon`,
  :func:`calibrate`), and a run's spending, round by round, and its budget (:class:`PrivacyLedger`);
- :mod:`~fedflat.privacy.stage`: the upload path's ``dp`` stage, client-level DP on each release, central or local,
  fixed or adaptive clip (:class:`GaussianMechanism`), registered by :mod:`fedflat.algorithms`, and its Gaussian
  noise, keyed or from the OS's secure source (:func:`secure_normal`);

Instance-level DP (DP-SGD) is computed by the engine's oracle (``privacy.level: instance``); this package accounts it.
The package sits just above :mod:`fedflat.core` (it imports nothing else of fedflat), so the methods, the config and
the engine all import it. The config, the calibration and the accounting import no torch (``fedflat --help`` loads
none): the names of the torch modules load on first use.
"""
from __future__ import annotations

from typing import Any

from fedflat.privacy.accounting import Mechanism, PrivacyLedger, calibrate, epsilon, unconverged_orders
from fedflat.privacy.calibration import calibrated_noise, client_mechanism, delta_of, dp_stage
from fedflat.privacy.config import PrivacyConfig, check_upload_path

_TORCH = {"stage": ("CLIP", "UNCLIPPED", "GaussianMechanism", "GaussianParams", "gaussian_like", "secure_normal")}


def __getattr__(name: str) -> Any:
    import importlib

    for module, names in _TORCH.items():
        if name in names:
            return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLIP", "UNCLIPPED", "GaussianMechanism", "GaussianParams", "Mechanism", "PrivacyConfig", "PrivacyLedger",
           "calibrate", "calibrated_noise", "check_upload_path", "client_mechanism", "delta_of", "dp_stage", "epsilon",
           "gaussian_like", "secure_normal", "unconverged_orders"]
