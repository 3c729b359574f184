"""The hand-derived gradient of fedflat's MLP and LogReg (:mod:`fedflat.engine.mlp_gradient`) as a backend.

fedflat's own MLP and LogReg under plain cross-entropy in float32 on the CPU (``ModelTraits.hand_gradient``, decided
once per model; the backend chosen once per run by :func:`fedflat.engine.gradients.choose_backend`) skip autograd
on the sequential engine: :class:`~fedflat.engine.mlp_gradient.MLPGradient` runs the forward pass and the backward
formulas autograd would run, the same ATen operations on the same operands, and writes each layer's gradient into
its slice of ``g[P]`` (no graph, no ``torch.cat``): the same bits, and W1's rounds in less CPU time
(docs/architecture.md, "Gradient backends"). Every other objective, a batch it does not take and every evaluation
keep the general backend's autograd.
"""
from __future__ import annotations

from fedflat.engine.gradients.backend import Accelerated, Backend
from fedflat.engine.mlp_gradient import MLPGradient


class HandMLP(Accelerated):
    """The data loss's gradient by :class:`~fedflat.engine.mlp_gradient.MLPGradient` (its C++ operator where built)."""

    def __init__(self, hand: MLPGradient, inner: Backend):
        super().__init__(inner)
        self.hand = hand

    @property
    def gradient(self) -> str:
        """``native`` (the hand-derived gradient as one C++ operator) or ``python`` (the same in Python: the operator
        is off or could not be built)."""
        return "native" if self.hand.native is not None else "python"

    def data_pass(self, w, x, y):
        if self.hand.takes(w, x, y):
            return self.hand.loss_grad(w, x, y)
        return self.inner.data_pass(w, x, y)
