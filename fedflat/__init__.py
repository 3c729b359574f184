"""fedflat: federated learning with sharpness-aware minimization, side by side, tested and fast."""
import os

# OpenMP threads of torch wait passively for work, so runs sharing the cores do not spin against each other
# (measured: >300 s instead of 30 s for two runs on 2 cores; fedflat/engine/cores.py). Must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fedflat._version import __version__  # noqa: E402
from fedflat.config import Config, load_config
from fedflat.core import ConfigError


def __getattr__(name: str):
    """``fedflat.run`` and ``fedflat.History`` load the engine (and torch) on first use."""
    if name in ("run", "History"):
        from fedflat import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedflat' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "History", "load_config", "run", "__version__"]
