"""``compile: true``: the data loss's forward and backward pass compiled by ``torch.compile`` (TorchInductor).

On a GPU a mid-sized network's local step at a small batch is bound by many small memory-bound kernels, not by its
convolutions: on an H100, W3's ResNet-18-GN round in bf16 spent 20% of its kernel time in GroupNorm, 32% in
element-wise kernels (autocast's casts around GroupNorm, ReLU, the residual adds) and 20% converting layouts around
cuDNN's convolutions, 16% in the convolutions (docs/benchmarks.md, "GPU, fourth session"). Inductor fuses a
normalization with its casts and activation into one kernel and picks the convolutions' memory layout for the
whole network, which no eager module can. The compiled pass computes the same function: its numbers differ from
the eager pass's by the rounding of a different order of operations (tests/test_compile.py bounds it in float32).

The compiled function is the sequential engine's own data loss (:data:`~fedflat.engine.gradients.DATA_LOSS` at a
client's per-tensor views); autograd differentiates it as it would the eager pass (AOTAutograd compiles the
backward with it). Compiling costs seconds to a minute at a run's first step, once per batch shape until a second
shape makes the batch dimension dynamic; :class:`~fedflat.engine.gradients.Graphed` and
:class:`~fedflat.engine.gradients.Lanes` then capture and replay the compiled kernels like the eager ones.
"""
from __future__ import annotations

import os

import torch

from fedflat.core import ConfigError
from fedflat.engine.gradients.backend import Accelerated, Backend, autograd_pass
from fedflat.engine.gradients.objectives import DATA_LOSS


class Compiled(Accelerated):
    """``inner``'s data pass (one client's, the sequential engine's ``data_pass(w, x, y)``) with the loss compiled
    by ``torch.compile`` and differentiated by autograd; every other objective goes to the general backend."""

    def __init__(self, inner: Backend):
        super().__init__(inner)
        forward = self.forward

        def data_loss(views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return DATA_LOSS(forward, views, x, y)[0]

        level_cache()
        self.compiled_loss = torch.compile(data_loss)

    @property
    def gradient(self) -> str:
        return "compiled"

    def data_pass(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, g[P])`` of one client's data loss, as :meth:`PerClient.data_pass
        <fedflat.engine.gradients.PerClient.data_pass>` computes it, from the compiled forward and backward."""
        try:
            return autograd_pass(self.forward, w, x, y, self.compiled_loss)
        except torch._dynamo.exc.BackendCompilerFailed as err:  # (no compiler, an unsupported GPU or operator)
            reason = str(err).strip().splitlines()[0]
            raise ConfigError(f"compile: true: torch.compile could not compile the model's pass on this machine "
                              f"({reason}); set compile: false (the same numbers to rounding, uncompiled)") from err


def level_cache() -> None:
    """Where ``ATEN_CPU_CAPABILITY`` forces ATen's dispatch level (default, avx2, avx512) and
    ``TORCHINDUCTOR_CACHE_DIR`` names no folder of the user's (unset, or torch's default, which importing
    ``torch._dynamo`` sets), Inductor's cache gets a folder of that level's own: it keys the C++ it generates by the
    graph, not by the level, and reused code generated for another level (AVX-512's vector helpers in a default-level
    build) fails to compile."""
    level = os.environ.get("ATEN_CPU_CAPABILITY")
    if not level:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"aten-{level.strip().lower()}")
