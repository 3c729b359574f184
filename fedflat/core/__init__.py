"""The contract a federated method is written against: fedflat's bottom layer.

Everything a part needs lives here and imports nothing else of fedflat: the part and role bases
(:mod:`fedflat.core.part`), the data of a round and its keyed random streams (:mod:`fedflat.core.round`), the
registries of parts and recipes (:mod:`fedflat.core.registry`), initial values of declared state
(:mod:`fedflat.core.init`), the errors (:mod:`fedflat.core.errors`), the table of every role's hooks
(:mod:`fedflat.core.hooks`) and flat-vector helpers (:mod:`fedflat.core.vectors`). A method written against these
names runs on every engine and executor; docs/extending.md shows how.

Names load on first use, so importing :mod:`fedflat.core.errors` (as the torch-free config does) does not
import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "errors": ("AlgorithmError", "BudgetSpent", "ConfigError", "ContractError", "Diverged", "NoClients",
               "PluginError"),
    "vectors": ("NORM_EPS", "BufferLayout", "ParamLayout", "normalize_rows", "normalize_rows_", "persistent_buffers",
                "row_norm", "CLIP_GRAD_EPS", "all_finite", "clip_factors", "clip_rows", "clip_scale",
                "non_finite_rows", "unclipped", "trainable_parameters"),
    "round": ("SERVER", "numpy_stream", "sample_clients", "stream_seed", "torch_stream", "BUFFERS", "MODEL",
              "TRAIN_LOSS", "Batch", "Broadcast", "ClientContext", "ClientData", "ClientResult", "ClipScope", "Cohort",
              "Distillation", "GradientOracle", "RoundContext", "Shared", "Slot", "TrainSettings", "LocalOptimizer",
              "merge_results", "ResultRows", "payload_size", "Contrast", "OBJECTIVE_TERM"),
    "part": ("SHARED", "Aggregation", "Correction", "Direction", "Filter", "Part", "PartParams", "Personalization",
             "Perturbation", "ServerUpdate", "shared", "MeasuredDirection"),
    "init": ("Init",),
    "hooks": ("HOOKS", "ROLE_HOOKS", "Hook", "hook_table"),
    "upload": ("STAGE_ORDER", "Release", "UploadPath", "UploadStage", "release_norms", "release_of", "scale_release",
               "upload_of"),
    "registry": ("MOMENTUM_WEIGHT_GRID", "PARTS", "RECIPES", "RHO_GRID", "ROLES", "STAGES", "Recipe", "closest",
                 "composition_label", "register_part", "register_recipe"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fedflat.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
