"""FedBN (Li et al., *FedBN: Federated Learning on Non-IID Features via Local Batch Normalization*, ICLR 2021):
the personalization role for feature shift.

Every BatchNorm layer stays with its client: its affine parameters (``weight``, ``bias``) and its statistics
(``running_mean``, ``running_var``, ``num_batches_tracked``). A client starts its local training from the
broadcast model with its own BatchNorm parameters and statistics, trains all of them with the method's local
optimizer, keeps its BatchNorm entries, and uploads the broadcast's values there, so the server averages every
other parameter and buffer and never sees a client's normalization (FedBN's Algorithm 1: "aggregate all but the
BN layers"). Each client evaluates with its own BatchNorm (personalized evaluation, as FedPer's: the global model
with the client's private entries on test samples of its own distribution).

The mechanics are FedPer's (:class:`~fedflat.algorithms.fedper.FedPer`: the private parameters ride in the client's
kept model); the private buffer entries are kept by the engine (:meth:`Personalization.private_buffers`). A model
without BatchNorm is refused, naming the built-in option that has it (``model.norm=batch``).

Recipe ``fedbn`` (FedBN as published: local SGD, FedAvg's aggregation); any method takes
``algo.personalization=fedbn``.
"""
from __future__ import annotations

import functools

import torch

from fedflat.algorithms.fedper import FedPer
from fedflat.core import AlgorithmError, BufferLayout, ParamLayout, PartParams, Recipe, TrainSettings, register_recipe


class FedBN(FedPer):
    """The model's BatchNorm layers (parameters and statistics) stay on each client."""

    name = "fedbn"
    summary = "FedBN: every BatchNorm layer (affine parameters and running statistics) stays on each client"
    Params = PartParams

    def private(self, settings: TrainSettings) -> torch.Tensor:
        layout = self.layout(settings)
        if not settings.batch_norms:
            raise AlgorithmError("personalization=fedbn keeps BatchNorm layers on the clients, but the model has none "
                                 "(the built-in ResNets, WRN, DenseNet and CNN have them with model.norm=batch)")
        return batch_norm_parameters(layout, settings.batch_norms)

    def private_buffers(self, settings: TrainSettings) -> torch.Tensor | None:
        self.private(settings)  # the same check
        return None if settings.buffers is None else batch_norm_buffers(settings.buffers, settings.batch_norms)


@functools.lru_cache(maxsize=16)
def batch_norm_parameters(layout: ParamLayout, modules: tuple[str, ...]) -> torch.Tensor:
    """The mask ``[P]`` of the parameters of the BatchNorm ``modules`` (their affine weight and bias)."""
    return layout.mask(frozenset(modules))


@functools.lru_cache(maxsize=16)
def batch_norm_buffers(layout: BufferLayout, modules: tuple[str, ...]) -> torch.Tensor:
    """The mask ``[Q]`` of the buffers of the BatchNorm ``modules`` (their running statistics)."""
    return layout.mask(frozenset(modules))


register_recipe(Recipe(
    name="fedbn", display="FedBN",
    summary="FedBN: local SGD, FedAvg aggregation of everything but the BatchNorm layers, which stay "
                          "on each client (feature-shift non-IID)",
    source="Li et al., ICLR 2021", personalization="fedbn"))
