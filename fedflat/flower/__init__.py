"""fedflat on Flower: any fedflat config as a Flower app, simulated or deployed (docs/flower.md).

- :class:`FedflatStrategy`: a Flower ``Strategy`` running a fedflat recipe's server side;
- :func:`client_app` / :func:`server_app`: the ``ClientApp`` (a node's clients, data and kept state) and
  the ``ServerApp`` (fedflat's run loop over a Flower grid) for a config;
- :func:`simulate`: a Flower simulation of a config in this process; :func:`write_app`: the app project
  ``flwr run`` takes (``fedflat flower-app``).

Names are imported on first use, so ``fedflat`` works (and its CLI lists the Flower commands) without
Flower installed; using one without Flower is a clear error.
"""
from __future__ import annotations

import importlib

FLOWER_HINT = "fedflat's Flower layer needs Flower: pip install 'fedflat[flower]' (flwr 1.41.0)"

_WHERE = {"FedflatStrategy": "server", "serve": "server", "client_app": "apps", "server_app": "apps",
          "simulate": "apps", "write_app": "apps"}
__all__ = sorted(_WHERE)


def require_flower():
    """The ``flwr`` package, or a :class:`~fedflat.config.ConfigError` saying how to install it."""
    try:
        return importlib.import_module("flwr")
    except ImportError:
        from fedflat.core import ConfigError

        raise ConfigError(FLOWER_HINT) from None


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'fedflat.flower' has no attribute {name!r}")
    require_flower()
    return getattr(importlib.import_module(f"fedflat.flower.{_WHERE[name]}"), name)
