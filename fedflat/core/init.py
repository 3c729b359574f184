"""Initial values of the server state a part declares (:attr:`fedflat.core.Part.server_state`).

    server_state = {"scaffold.c": init.zeros, "wmsam.a": init.scalar("a"), "gmt.trajectory": init.model}

Each is a function ``(w0, settings, params) -> tensor`` of the initial model, the shared training settings and
the part's hyperparameters; fedflat calls it once, before round 0 (a resumed run loads the state instead).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fedflat.core.round import TrainSettings

Init = Callable[[torch.Tensor, TrainSettings, Any], torch.Tensor]  # (w0, settings, the part's params) -> tensor


def zeros(w0: torch.Tensor, settings: TrainSettings, params: Any) -> torch.Tensor:
    """A model-sized vector of zeros (a control variate, a momentum, a dual before round 0)."""
    return torch.zeros_like(w0)


def model(w0: torch.Tensor, settings: TrainSettings, params: Any) -> torch.Tensor:
    """The initial model ``w^0`` itself (FedGMT's trajectory starts there)."""
    return w0.clone()


def flag(w0: torch.Tensor, settings: TrainSettings, params: Any) -> torch.Tensor:
    """A boolean scalar, false before round 0 ("has the server seen a round yet")."""
    return torch.zeros((), dtype=torch.bool, device=w0.device)


def per_client(w0: torch.Tensor, settings: TrainSettings, params: Any) -> torch.Tensor:
    """One zero per client of the federation, ``[N]`` (FedAWA's logit shifts)."""
    return torch.zeros(settings.num_clients, dtype=w0.dtype, device=w0.device)


def scalar(value: float | str, dtype: torch.dtype | None = None, device: str | None = None) -> Init:
    """A scalar: ``value``, or the hyperparameter of that name (FedWMSAM's factor starts at ``algo.a``);
    ``dtype`` (default the model's) and ``device`` (default the model's) as given."""
    def init(w0: torch.Tensor, settings: TrainSettings, params: Any) -> torch.Tensor:
        v = getattr(params, value) if isinstance(value, str) else value
        return torch.tensor(v, dtype=dtype or w0.dtype, device=w0.device if device is None else device)
    init.__qualname__ = f"scalar({value!r})"
    return init


def vector(size: int | str, dtype: torch.dtype | None = None, device: str | None = None) -> Init:
    """Zeros of length ``size``, or of the hyperparameter of that name (FedSCAM's ``summary_dim``)."""
    def init(w0: torch.Tensor, settings: TrainSettings, params: Any) -> torch.Tensor:
        n = getattr(params, size) if isinstance(size, str) else size
        return torch.zeros(n, dtype=dtype or w0.dtype, device=w0.device if device is None else device)
    init.__qualname__ = f"vector({size!r})"
    return init
