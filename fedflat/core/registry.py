"""The registries of parts and recipes: every part and method, built in or a plugin's, is found here by name.

A recipe names one part per role plus default hyperparameters; the config's ``algo`` section names a recipe
and may swap any role (``algo.filter=fft`` on ``fedlesam``) or set a part's hyperparameter.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from fedflat.core.part import Part

ROLES = ("perturbation", "filter", "correction", "aggregation", "server", "personalization")
PARTS: dict[str, dict[str, type[Part]]] = {role: {} for role in ROLES}
RECIPES: dict[str, "Recipe"] = {}

# The SAM radius grid of the seeds: FedLESAM tunes rho in {0.05, 0.01, 0.005, 0.001, 0.0005} for every method
# (seed 002 §E.1); 0.1 is the radius FedSMOO, FedLESAM-S/D and FedFFT run at (seeds 002, 004).
RHO_GRID = (0.1, 0.05, 0.01, 0.005, 0.001, 0.0005)
# The weight ``a`` of the local gradient in the client momentum ``a g + (1 - a) m`` (FedCM, MoFedSAM): one grid,
# so that the two methods, which differ only by SAM, search the same values.
MOMENTUM_WEIGHT_GRID = (0.05, 0.1, 0.2, 0.5)


def closest(word: str, options) -> str:
    """`` (did you mean 'x'?)`` when a close option exists."""
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def register_part(cls: type[Part]) -> type[Part]:
    PARTS[cls.role][cls.name] = cls
    return cls


@dataclass(frozen=True)
class Recipe:
    """A named method: a part per role, default hyperparameters, its source, and ``tunable``: the grid of each
    hyperparameter a fair comparison tunes (dotted config keys, ``algo.rho``; the seeds' or the original paper's
    grid), which `fedflat tune` searches."""

    name: str
    summary: str
    source: str
    perturbation: str = "none"
    filter: str = "none"
    correction: str = "none"
    aggregation: str = "mean"
    server: str = "avg"
    personalization: str = "none"
    defaults: dict[str, Any] = field(default_factory=dict)
    tunable: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def part_names(self) -> dict[str, str]:
        return {role: getattr(self, role) for role in ROLES}


def composition_label(section: dict[str, Any]) -> str:
    """A method's name, or — when its roles differ from its recipe's — the composition it is:
    ``fedlesam[correction=scaffold,filter=fft]``. Never a name that labels other parts."""
    name = section.get("name", "fedavg")
    recipe = RECIPES.get(name)
    if recipe is None:
        return str(name)
    changed = [f"{role}={section[role]}" for role in ROLES
               if role in section and section[role] != recipe.part_names()[role]]
    return f"{name}[{','.join(changed)}]" if changed else name


def register_recipe(recipe: Recipe) -> Recipe:
    RECIPES[recipe.name] = recipe
    return recipe
