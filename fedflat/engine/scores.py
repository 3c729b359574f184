"""Evaluation metrics beyond accuracy (``eval.metrics``), computed with torchmetrics on the held-out predictions of
the central evaluation (the global model on the test set) and of the personalized one (each client's model on
its own test share, pooled over the clients as the personalized accuracy is).

- ``f1``: macro-averaged F1 over the classes (``MulticlassF1Score(average="macro")``);
- ``balanced_accuracy``: the mean of the per-class recalls (``MulticlassAccuracy(average="macro")``), which
  non-IID studies report because it does not favour the frequent classes;
- ``per_class_accuracy``: each class's recall, ``acc_class_<k>`` (``MulticlassAccuracy(average=None)``);
- ``auroc``: macro one-vs-rest area under the ROC curve of the softmax probabilities (``MulticlassAUROC``).

A class absent from the targets counts as torchmetrics counts it: left out of the macro averages when it is never
predicted either, a recall of 0 when it is (and ``acc_class_<k> = 0``); compare runs on the same test set.
"""
from __future__ import annotations

import torch

METRIC_NAMES = ("f1", "balanced_accuracy", "per_class_accuracy", "auroc")


class MetricSet:
    """The torchmetrics of ``names`` for ``num_classes`` classes on ``device``: :meth:`update` with each batch's
    logits and targets, :meth:`compute` the values (``{"f1": ..., "acc_class_0": ..., ...}``), then :meth:`reset`."""

    def __init__(self, names: list[str], num_classes: int, device: torch.device | str = "cpu"):
        from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

        unknown = sorted(set(names) - set(METRIC_NAMES))
        if unknown:
            raise ValueError(f"unknown evaluation metric {unknown[0]!r}; choose from {', '.join(METRIC_NAMES)}")
        build = {"f1": lambda: MulticlassF1Score(num_classes, average="macro"),
                 "balanced_accuracy": lambda: MulticlassAccuracy(num_classes, average="macro"),
                 "per_class_accuracy": lambda: MulticlassAccuracy(num_classes, average=None),
                 "auroc": lambda: MulticlassAUROC(num_classes, average="macro")}
        self.metrics = {name: build[name]().to(device) for name in dict.fromkeys(names)}

    def update(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        probs = logits.float().softmax(-1)
        for metric in self.metrics.values():
            metric.update(probs, y)

    def compute(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            if name == "per_class_accuracy":
                out.update({f"acc_class_{k}": float(v) for k, v in enumerate(value.tolist())})
            else:
                out[name if name != "balanced_accuracy" else "balanced_acc"] = float(value)
        return out

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
