"""The federated-LoRA baselines: FedSA-LoRA (a personalization) and FFA-LoRA (a recipe over the adapter option).

**FedSA-LoRA** (Guo et al., *Selective Aggregation for Low-Rank Adaptation in Federated Learning*, ICLR 2025): of
each adapter ``W0 + (alpha / r) B A``, the ``A`` matrices learn what the clients share and are aggregated, the
``B`` matrices what is each client's own and stay on it; the classifier head is aggregated with ``A``. It is FedPer's
mechanism (:class:`~fedflat.algorithms.fedper.FedPer`) with the private entries being every ``lora_B``: a client
trains from the broadcast ``A`` and its own ``B``, keeps its ``B`` and uploads the broadcast's in its place, and
evaluation is personalized. Any method takes it: ``algo=fedsam algo.personalization=fedsa``.

**FFA-LoRA** (Sun et al., *Improving LoRA in Privacy-preserving Federated Learning*, ICLR 2024) freezes every ``A`` at
its random initialization and trains ``B`` alone, which the ``adapter`` section's ``freeze_a: true`` builds into the
model (:mod:`fedflat.models.lora`); the recipe ``ffa-lora`` is FedAvg with that option set (a config with no adapter
section is refused, one that sets ``freeze_a: false`` too), and any method composes with it the same way
(``algo=fedsam adapter.freeze_a=true``).
"""
from __future__ import annotations

import functools

import torch

from fedflat.algorithms.fedper import FedPer
from fedflat.core import AlgorithmError, PartParams, Recipe, TrainSettings, register_recipe

LORA_B = ".lora_B."  # peft's name of an adapter's B matrix (AdaLoRA's too)


class FedSAParams(PartParams):
    pass


class FedSA(FedPer):
    """Every adapter's ``B`` stays on its client (FedSA-LoRA); ``A`` and the head are federated."""

    name = "fedsa"
    summary = "FedSA-LoRA: each adapter's B stays on its client; A and the head are aggregated"
    Params = FedSAParams

    def private(self, settings: TrainSettings) -> torch.Tensor:
        return lora_b_mask(self.layout(settings))


@functools.lru_cache(maxsize=16)
def lora_b_mask(layout) -> torch.Tensor:
    """The mask ``[P]`` of the entries of every LoRA ``B`` matrix in the flat vector; refused naming why where the
    model has none (a run without adapters)."""
    mask = torch.zeros(layout.size, dtype=torch.bool)
    for name, offset, numel in zip(layout.names, layout.offsets, layout.numels):
        if LORA_B in name:
            mask[offset:offset + numel] = True
    if not mask.any():
        raise AlgorithmError("personalization=fedsa keeps each client's LoRA B matrices, but the model has no "
                             "trainable lora_B: add an adapter section (adapter.method=lora)")
    return mask


FEDSA, FFA = "Guo et al., ICLR 2025", "Sun et al., ICLR 2024"
register_recipe(Recipe(
    name="fedsa-lora", display="FedSA-LoRA", summary="FedSA-LoRA: LoRA's A aggregated, B kept by each client",
    source=FEDSA, personalization="fedsa", adapter={"method": "lora"}))
register_recipe(Recipe(
    name="ffa-lora", display="FFA-LoRA", summary="FFA-LoRA: FedAvg with LoRA's A frozen at its random start "
                                                 "(sets adapter.freeze_a=true)",
    source=FFA, adapter={"freeze_a": True}))
