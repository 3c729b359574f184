"""Optional TensorBoard logging of a run's metrics (config key ``tensorboard: true``).

Every numeric field of each metrics line goes to ``RUN_DIR/tensorboard`` as a scalar at step =
round, next to ``metrics.jsonl``. On resume, events of rounds after the checkpoint are purged
(``purge_step``) so that the curves show each round once.
"""
from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any, Callable

from fedflat.core import ConfigError

INSTALL_HINT = ("tensorboard=true needs the optional 'tensorboard' package: "
                "pip install 'fedflat[tensorboard]' (or pip install tensorboard), or set tensorboard=false")


class TensorBoardMissing(ConfigError):
    """The ``tensorboard`` package is not installed."""


def require_tensorboard() -> None:
    """Raises :class:`TensorBoardMissing` (with the install line) unless tensorboard is importable."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise TensorBoardMissing(INSTALL_HINT)


def summary_writer(log_dir: Path, purge_step: int | None = None):
    """A ``torch.utils.tensorboard.SummaryWriter``, or :class:`TensorBoardMissing` with the install line."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TensorBoardMissing(INSTALL_HINT) from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def tensorboard_hook(log_dir: Path, purge_step: int | None = None) -> Callable[[Any, int, dict | None], None]:
    """A runner hook writing every numeric field of each evaluated round's metrics line."""
    writer = summary_writer(log_dir, purge_step)

    def hook(runner, t: int, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        step = record["round"]
        for key, value in record.items():
            if key != "round" and isinstance(value, numbers.Real) and not isinstance(value, bool):
                writer.add_scalar(key, float(value), step)
        writer.flush()

    return hook
