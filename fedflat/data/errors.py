"""The data layer's error (kept apart so that the adapters, which :mod:`fedflat.data.dataset` calls, raise it
without importing it back)."""
from __future__ import annotations

from fedflat.core import ConfigError


class DatasetError(ConfigError):
    """A dataset that cannot be trained on as given (dtype, shape, labels, NaN): the message says what to fix."""
