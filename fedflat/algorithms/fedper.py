"""FedPer (Arivazhagan et al., *Federated Learning with Personalization Layers*, 2019): the personalization role.

The model's last ``K_P`` layers (its classifier head) stay with each client; the layers below them (the base,
the feature extractor) are federated as usual. A client starts its local training from the broadcast base and
its own head, trains both with the method's local optimizer (SAM, FedFFT's filtered SAM, ...: seed 004 §E.4
replaces FedPer's local optimizer and keeps everything else), keeps its head, and uploads the broadcast's
values in the head's place: the server aggregates the base only and never sees a head. Evaluation is then
personalized: each client's model (the global base and its head) on test samples of its own distribution
(:func:`fedflat.data.client_test_split`).

Recipes: ``fedper`` (FedPer as published: local SGD), ``fedper-sam`` and ``fedper-fft`` (seed 004 Table 11's
FedPer + SAM and FedPer + FFT-SAM). ``personalization=none`` (every other recipe's default) keeps nothing
private, and any method takes ``algo.personalization=fedper``, e.g. ``algo=fedlesam algo.personalization=fedper``.
"""
from __future__ import annotations

import functools

import torch
from pydantic import Field

from fedflat.algorithms.fedfft import FFT_GRID
from fedflat.core import (MODEL, AlgorithmError, ClientContext, Cohort, ParamLayout, PartParams, Personalization,
                          Recipe, TrainSettings, register_recipe)

PERSONAL_MODEL = "fedper.w_i"  # client state: the client's last local model (only its private entries are read)


class NoPersonalization(Personalization):
    name = "none"
    summary = "every parameter is federated"


class FedPerParams(PartParams):
    personal_layers: int = Field(1, ge=1, description="K_P: the model's last layers (modules with parameters) "
                                                      "each client keeps private; 1 = the classifier head")


class FedPer(Personalization):
    """The last ``personal_layers`` layers stay private (FedPer's personalization layers)."""

    name = "fedper"
    summary = "FedPer: the last personal_layers layers (the head) stay on each client; the base is federated"
    Params = FedPerParams
    keeps = (PERSONAL_MODEL,)

    def private(self, settings: TrainSettings) -> torch.Tensor:
        return private_layers(self.layout(settings), self.p.personal_layers)

    def layout(self, settings: TrainSettings) -> ParamLayout:
        """The model's parameter layout, which every mask of private parameters is made from."""
        if settings.layout is None:
            raise AlgorithmError(f"personalization={self.name} needs the model's parameter layout (settings.layout)")
        return settings.layout

    def models(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
               settings: TrainSettings) -> torch.Tensor:
        """``w`` with each client's head from its last local model (``w``'s head before its first round)."""
        mask = self.private(settings).to(w.device)
        return torch.where(mask & known[PERSONAL_MODEL][:, None].to(w.device), state[PERSONAL_MODEL].to(w.device), w)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        """Keeps the final local model (its head is the client's) and uploads the broadcast head in its place."""
        cohort.new_state[PERSONAL_MODEL] = W
        mask = self.private(ctx.settings).to(W.device)
        cohort.upload[MODEL] = torch.where(mask, ctx.w_broadcast, W)


@functools.lru_cache(maxsize=16)
def private_layers(layout, layers: int) -> torch.Tensor:
    """The mask ``[P]`` of the parameters of the model's last ``layers`` modules (a module: the parameters that
    share a name up to the last dot, e.g. ``fc.weight`` and ``fc.bias``), in the model's parameter order."""
    modules = list(dict.fromkeys(name.rpartition(".")[0] for name in layout.names))
    if layers >= len(modules):
        raise AlgorithmError(f"algo.personal_layers={layers}: the model has {len(modules)} layers with parameters "
                             f"({', '.join(m or '(root)' for m in modules)}); at least one must stay shared")
    private = set(modules[-layers:])
    mask = torch.zeros(layout.size, dtype=torch.bool)
    for name, offset, numel in zip(layout.names, layout.offsets, layout.numels):
        if name.rpartition(".")[0] in private:
            mask[offset:offset + numel] = True
    return mask


FEDPER = "Arivazhagan et al., arXiv:1912.00818, 2019"
register_recipe(Recipe(
    name="fedper", display="FedPer",
    summary="FedPer: local SGD, the last personal_layers layers (the head) stay on each client",
    source=FEDPER, personalization="fedper"))
register_recipe(Recipe(
    name="fedper-sam", display="FedPer-SAM", summary="FedPer with SAM as the local optimizer (FedFFT's radii)",
    source=f"seed 004 (FedFFT) §E.4, Table 11; {FEDPER}", perturbation="sam", personalization="fedper",
    defaults={"rho": 0.1}, tunable=FFT_GRID))
register_recipe(Recipe(
    name="fedper-fft", display="FedPer-FFT", summary="FedPer with FedFFT's filtered SAM as the local optimizer",
    source=f"seed 004 (FedFFT) §E.4, Table 11; {FEDPER}", perturbation="sam", filter="fft",
    personalization="fedper", defaults={"rho": 0.1, "r": 0.01}, tunable=FFT_GRID))
