"""Federated methods as recipes of parts: perturbation, filter, correction, aggregation, server, personalization.

Every module of this package defines the parts of one method (or family) and registers its
recipes; importing the package imports them all, so a new method is one new module.
"""
import importlib
import pkgutil

from fedflat.algorithms.base import (MODEL, TRAIN_LOSS, Aggregation, Broadcast, ClientContext, ClientResult, Cohort,
                                     Correction, Distillation, Filter, Part, PartParams, Personalization, Perturbation,
                                     RoundContext, ServerUpdate, TrainSettings, merge_results, normalize_rows,
                                     payload_size, row_norm)
from fedflat.algorithms.registry import (PARTS, RECIPES, ROLES, Algorithm, AlgorithmError, Recipe, build_algorithm,
                                         register_part, register_recipe)

_INFRASTRUCTURE = {"base", "registry"}


def _load_methods() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _INFRASTRUCTURE:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Part) and obj.name and obj.__module__ == module.__name__:
                register_part(obj)


_load_methods()

__all__ = ["MODEL", "TRAIN_LOSS", "Aggregation", "Algorithm", "AlgorithmError", "Broadcast", "ClientContext",
           "ClientResult", "Cohort", "Correction", "Distillation", "Filter", "PARTS", "Part", "PartParams", "Personalization",
           "Perturbation", "RECIPES", "ROLES", "Recipe", "RoundContext", "ServerUpdate", "TrainSettings",
           "build_algorithm", "merge_results", "normalize_rows", "payload_size", "register_part", "register_recipe",
           "row_norm"]
