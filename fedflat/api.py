"""The Python API: ``fedflat.run(config) -> History``.

A thin front over :func:`fedflat.experiments.runner.run_experiment`, which runs the rounds and keeps the run
folder; :func:`fedflat.experiments.checkpoint.resume` continues a run folder.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fedflat.config import Config, as_config, quickstart_path
from fedflat.data import Dataset
from fedflat.engine.simulation import RoundResult, Simulation
from fedflat.experiments.callbacks import Callback, EarlyStopping, ModelCheckpoint, RunInfo
from fedflat.experiments.runner import History, run_experiment

__all__ = ["Callback", "EarlyStopping", "History", "ModelCheckpoint", "RunInfo", "as_config", "quickstart_path", "run"]


def run(config: Config | dict | str | Path | None = None, *, overrides: list[str] | tuple[str, ...] = (),
        dataset: Dataset | None = None, model_fn: Callable[[], nn.Module] | None = None,
        clients: Sequence[Sequence[int]] | None = None,
        out: str | Path | None = None, save: bool = True, progress: bool = True,
        run_dir: str | Path | None = None, resume: str | Path | None = None,
        announce: bool | None = None,
        driver: Callable[[Simulation], Callable[[int], RoundResult]] | None = None,
        callbacks: Sequence[Any] = (),
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> History:
    """Runs one federated experiment and returns its :class:`History`.

    ``config`` is a :class:`Config`, a dict, a YAML path, or None for the embedded quickstart;
    ``overrides`` are ``key=value`` strings. ``dataset`` (a :class:`fedflat.data.Dataset`) and
    ``model_fn`` (a zero-argument ``nn.Module`` factory) replace the configured ones; ``clients`` (one
    sequence of training-sample indices per client: a natural split) replaces ``data.partition`` and sets
    ``data.num_clients``. With ``save``,
    results go to a new folder under ``out`` (default ``config.out``), or to exactly ``run_dir``
    (created; it must not exist). ``resume`` continues the run folder it names from its latest
    checkpoint (:func:`fedflat.experiments.checkpoint.resume` also reads its config). ``announce``
    (default: ``progress``) prints the run folder to stderr as soon as it exists. ``driver(sim)`` returns
    the function that trains round ``t`` (default: ``sim.run_round``, on the config's executor);
    :mod:`fedflat.flower` passes one that trains each round on the nodes of a Flower federation.
    ``callbacks``: objects told of the run's start, each round, evaluation and checkpoint, and its end
    (:class:`Callback`, :mod:`fedflat.experiments.callbacks`), after the loggers of the config's ``loggers``
    (tensorboard, csv, wandb, mlflow: docs/experiments.md, "Tracking runs"). ``loss_fn(logits, y)``, returning one
    loss per sample (``reduction="none"``), replaces ``train.loss`` in every engine, executor and diagnostic
    (docs/experiments.md, "Loss and metrics").
    """
    return run_experiment(config, overrides=overrides, dataset=dataset, model_fn=model_fn, clients=clients, out=out,
                          save=save, progress=progress, run_dir=run_dir, resume=resume,
                          announce=announce, driver=driver, callbacks=callbacks,
                          loss_fn=loss_fn)
