"""The registries of parts and recipes: every part and method, built in or a plugin's, is found here by name.

A recipe names one part per role plus default hyperparameters; the config's ``algo`` section names a recipe
and may swap any role (``algo.filter=fft`` on ``fedlesam``) or set a part's hyperparameter.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from typing import Any

from fedflat.core.errors import AlgorithmError, PluginError
from fedflat.core.part import Part
from fedflat.core.round import Slot
from fedflat.core.upload import STAGE_ORDER, UploadStage

ROLES = ("perturbation", "filter", "correction", "aggregation", "server", "personalization")
PARTS: dict[str, dict[str, type[Part]]] = {role: {} for role in ROLES}
STAGES: dict[str, type[UploadStage]] = {}  # the stages of the upload path (fedflat.core.upload), by name
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


def origin_of(value: Any) -> str:
    """Where ``value`` is defined: ``module.qualname`` of a class or function."""
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


_ORIGINS: dict[tuple[int, str], str] = {}  # (id of the registry, name) -> where the registered thing came from


def add(registry: dict[str, Any], kind: str, name: str, value: Any, origin: str | None = None) -> None:
    """``registry[name] = value``, refusing a name another module registered already (a plugin clashing with a
    built-in or with another plugin); registering the same thing again (a module imported twice) is allowed.
    ``origin``: where ``value`` comes from (default: where it is defined)."""
    origin = origin or origin_of(value)
    before = _ORIGINS.get((id(registry), name))
    if name in registry and before is not None and before != origin:
        raise PluginError(f"{kind} '{name}' is registered twice: by {before} and by {origin}; rename one of them")
    _ORIGINS[(id(registry), name)] = origin
    registry[name] = value


def register_part(cls: type[Part]) -> type[Part]:
    """Makes ``cls`` available by its role and name; its declared state entries and slots must be named
    ``<part>.<symbol>`` (one naming convention: a checkpoint's keys say whose they are)."""
    if cls.role not in PARTS and cls.role != UploadStage.role:
        raise AlgorithmError(f"part {cls.__qualname__}: role {cls.role!r} is not one of {', '.join(ROLES)}, "
                             f"{UploadStage.role}")
    if cls.role == UploadStage.role and cls.kind not in STAGE_ORDER:
        raise AlgorithmError(f"upload stage {cls.__qualname__}: kind {cls.kind!r} is not one of "
                             f"{', '.join(STAGE_ORDER)}")
    names = [*cls.server_state, *cls.sends, *cls.keeps, *cls.holds, *(cls.side if issubclass(cls, UploadStage) else ()),
             *(s.name for s in (*cls.provides, *cls.requires) if isinstance(s, Slot))]
    unscoped = [n for n in names if "." not in n.strip(".")]
    if unscoped:
        raise AlgorithmError(f"{cls.role} '{cls.name}' ({cls.__module__}): state and slot names read "
                             f"'<part>.<symbol>' (e.g. 'scaffold.c'); rename {unscoped}")
    add(STAGES if cls.role == UploadStage.role else PARTS[cls.role], cls.role, cls.name, cls)
    return cls


@dataclass(frozen=True)
class Recipe:
    """A named method: a part per role, default hyperparameters, its source, and ``tunable``: the grid of each
    hyperparameter a fair comparison tunes (dotted config keys, ``algo.rho``; the seeds' or the original paper's
    grid), which `fedflat tune` searches.

    ``defaults`` are keyed like the config: ``rho`` when one of the recipe's parts owns it (or all its owners
    share it), ``correction.beta`` to name the part; they apply only to the recipe's own parts, never to a part
    a config swaps in."""

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
    privacy: dict[str, Any] = field(default_factory=dict)  # a method under DP (DP-FedSAM): its `privacy` section
    compression: dict[str, Any] = field(default_factory=dict)  # ... and its `compression` (DP-FedSAM-top_k)
    adapter: dict[str, Any] = field(default_factory=dict)  # a method of adapters (FFA-LoRA): its `adapter` options
    display: str = ""  # the name its paper writes (FedAvg, FedLESAM): tables and figures show it

    def part_names(self) -> dict[str, str]:
        return {role: getattr(self, role) for role in ROLES}

    @property
    def title(self) -> str:
        """The method's name as its paper writes it (:attr:`display`), else its config name."""
        return self.display or self.name


def composition_label(section: dict[str, Any]) -> str:
    """A method's name, or — when its roles differ from its recipe's — the composition it is:
    ``fedlesam[correction=scaffold,filter=fft]``. Never a name that labels other parts. Roles may be given as a
    part's name or as its scoped mapping (``{name: scaffold, ...}``)."""
    name = section.get("name", "fedavg")
    recipe = RECIPES.get(name)
    if recipe is None:
        return str(name)

    def part_of(role: str) -> str | None:
        value = section.get(role)
        return value.get("name") if isinstance(value, dict) else value

    changed = [f"{role}={part_of(role)}" for role in ROLES
               if part_of(role) is not None and part_of(role) != recipe.part_names()[role]]
    return f"{name}[{','.join(changed)}]" if changed else name


def display_label(label: str) -> str:
    """A :func:`composition_label` as a paper names the method: ``FedLESAM``, ``FedLESAM[correction=scaffold]``
    (a name no recipe has is left as it is)."""
    name, bracket, rest = label.partition("[")
    recipe = RECIPES.get(name)
    return (recipe.title if recipe is not None else name) + bracket + rest


def register_recipe(recipe: Recipe) -> Recipe:
    """Makes ``recipe`` available by name (``algo=NAME``); a name another module registered is refused."""
    add(RECIPES, "recipe", recipe.name, recipe, origin=f"module {sys._getframe(1).f_globals.get('__name__', '?')}")
    return recipe
