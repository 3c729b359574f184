"""The Python API: ``fedflat.run(config) -> History``.

:func:`run` is :func:`fedflat.experiments.runner.run_experiment` (its options and docstring, given once there), which
runs the rounds and keeps the run folder; :func:`fedflat.experiments.resume.resume` continues a run folder.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fedflat.config import Config, as_config, quickstart_path
from fedflat.experiments.callbacks import Callback, EarlyStopping, ModelCheckpoint, RunInfo
from fedflat.experiments.runner import History, run_experiment

__all__ = ["Callback", "EarlyStopping", "History", "ModelCheckpoint", "RunInfo", "as_config", "quickstart_path", "run"]


@functools.wraps(run_experiment, assigned=("__doc__", "__annotations__"))
def run(config: Config | dict | str | Path | None = None, **options: Any) -> History:
    # the options and their documentation are run_experiment's (functools.wraps: help(fedflat.run) shows them)
    return run_experiment(config, **options)
