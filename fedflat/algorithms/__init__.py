"""Federated methods as recipes of parts: perturbation, filter, correction, aggregation, server, personalization.

Every module of this package defines the parts of one method (or family) against the contract in
:mod:`fedflat.core` and registers its recipes; importing the package imports them all. A researcher's own
method is written the same way in their own module and named in a config's ``plugins:`` (docs/extending.md).
"""
import importlib
import pkgutil

from fedflat.algorithms.compose import Algorithm, build_algorithm, renamed_state
from fedflat.core import PARTS, RECIPES, ROLES, AlgorithmError, Part, Recipe, register_part, register_recipe
from fedflat.privacy import stage as dp_stage

_INFRASTRUCTURE = {"compose"}


def register_parts_of(module) -> None:
    """Registers every part class defined in ``module`` (one with a ``name``)."""
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, Part) and obj.name and obj.__module__ == module.__name__:
            register_part(obj)


def _load_methods() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name not in _INFRASTRUCTURE:
            register_parts_of(importlib.import_module(f"{__name__}.{info.name}"))


_load_methods()
register_parts_of(dp_stage)  # the upload path's `dp` stage lives with its accounting, in fedflat.privacy

__all__ = ["Algorithm", "AlgorithmError", "PARTS", "RECIPES", "ROLES", "Recipe", "build_algorithm", "register_part",
           "register_recipe", "renamed_state"]
