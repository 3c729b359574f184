"""What a Python user brings in place of the config's data, model, split or loss: one :class:`UserInputs`, passed whole.

``fedflat.run(cfg, dataset=..., model_fn=..., clients=..., loss_fn=...)`` (and :func:`~fedflat.experiments.resume.
resume`, :func:`~fedflat.experiments.personal.evaluate_run`) gather them once into a :class:`UserInputs`, which the
runner, the checkpoint's :func:`~fedflat.engine.checkpoint.load_run` and :class:`~fedflat.engine.simulation.Simulation`
pass on as one object.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

from torch import nn

from fedflat.data import Dataset
from fedflat.engine.losses import LossFn


@dataclass(frozen=True)
class UserInputs:
    """``dataset`` (a :class:`fedflat.data.Dataset`) and ``model_fn`` (a zero-argument ``nn.Module`` factory) replace
    the configured ones; ``clients`` (one sequence of training-sample indices per client: a natural split,
    :func:`fedflat.data.user_split`) replaces ``data.partition``; ``loss_fn(logits, y)`` (one loss per sample)
    replaces ``train.loss``. None: the config's."""

    dataset: Dataset | None = None
    model_fn: Callable[[], nn.Module] | None = None
    clients: Sequence[Sequence[int]] | None = None
    loss_fn: LossFn | None = None

    def keywords(self) -> dict[str, Any]:
        """The inputs as the keyword arguments of ``fedflat.run``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def recorded(self, resolved: dict[str, Any]) -> dict[str, Any]:
        """The resolved config ``resolved`` as ``config.yaml`` records it: a user's dataset, model, split or loss
        by name (``user:<name>``); changed in place and returned."""
        if self.dataset is not None:
            resolved["data"]["name"] = f"user:{self.dataset.name}"
        if self.model_fn is not None:
            resolved["model"] = {"name": f"user:{getattr(self.model_fn, '__name__', 'model_fn')}"}
        if self.clients is not None:
            resolved["data"]["partition"] = {"scheme": f"user:{len(self.clients)} clients"}
        if self.loss_fn is not None:
            resolved["train"]["loss"] = f"user:{getattr(self.loss_fn, '__name__', 'loss_fn')}"
        return resolved
