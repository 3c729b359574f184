"""The errors of fedflat: each says what is wrong and what to do.

``ConfigError`` is every problem with what the user asked for (a key, a value, a name, a file); the others
are what can happen to a run on the way (a non-finite loss, a federation with no answering client).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and the fix."""


class AlgorithmError(ConfigError):
    """A bad algorithm name, role, hyperparameter or combination of parts."""


class PluginError(ConfigError):
    """A plugin that cannot be imported, or that registers a name already taken."""


class ContractError(AssertionError):
    """A part broke the contract it is written against (``FEDFLAT_CHECK_CONTRACT=1``): it modified a tensor it
    does not own in place, or read a server entry it was not sent."""


class Diverged(RuntimeError):
    """A non-finite loss or model: the run stops with ``status: diverged``."""


class BudgetSpent(RuntimeError):
    """The next round would spend more privacy than ``privacy.target_epsilon`` allows: the run stops with
    ``status: budget spent``, a finished run."""


class NoClients(RuntimeError):
    """No sampled client answered a round (every node of a federation failed): nothing to aggregate."""
