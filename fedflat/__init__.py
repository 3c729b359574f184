"""fedflat: federated learning with sharpness-aware minimization, side by side, tested and fast."""
__version__ = "0.1.0"

from fedflat.api import History, run  # noqa: E402
from fedflat.config import Config, ConfigError, load_config  # noqa: E402

__all__ = ["Config", "ConfigError", "History", "load_config", "run", "__version__"]
