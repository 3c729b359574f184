"""A run's config from its sources: a YAML file (and the ``base:`` it inherits), ``key=value`` overrides, a raw
tree or a :class:`Config`; the config's plugins imported for the run, then the whole validated
(:func:`fedflat.config.checks.validate`). The YAML is read as a researcher writes it (``1e-3`` a number), a file's
kind told from its keys, and a name found among the configs shipped in the package."""
from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fedflat import plugins
from fedflat.config.checks import validate
from fedflat.config.schema import AlgoSpec, Config, suggest
from fedflat.core.errors import ConfigError

# -- reading YAML, a file's kind, the shipped configs ------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: ``1e-3`` is a number (YAML 1.1, PyYAML's default, reads it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_yaml(text: str):
    """Parses YAML with numbers read as a researcher expects (``1e-3`` is a float)."""
    return yaml.load(text, Loader=_Loader)


def read_yaml_file(path: str | Path) -> Any:
    """A YAML file's content (:func:`config_file` finds the file). Invalid YAML is a one-line :class:`ConfigError`
    that names the file, line and column (PyYAML's own message names ``<unicode string>``, over five lines)."""
    path = Path(path)
    try:
        return read_yaml(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        raise ConfigError(f"{path}{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")) from None


def dump_yaml(tree: dict[str, Any]) -> str:
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=None)


def file_kind(spec: Any) -> str:
    """What a YAML file of fedflat's is, from its top-level keys: ``tune`` (it has ``methods``), ``sweep`` (a
    ``config``, ``grid``, ``overrides`` or ``variants``: none is a config key) or ``run`` (one run's config, which may
    inherit another with ``base``; ``fedflat sweep`` takes a file of only ``base`` and ``out`` as a one-cell sweep)."""
    keys = set(spec) if isinstance(spec, dict) else set()
    if "methods" in keys:
        return "tune"
    return "sweep" if keys & {"config", "grid", "overrides", "variants"} else "run"


def wrong_kind(name: str | Path, kind: str, wanted: str) -> ConfigError:
    """The error for a file given to the wrong command: it names the command that runs it."""
    what = {"run": "one run's config", "sweep": "a sweep file", "tune": "a tune file"}
    return ConfigError(f"{name} is {what[kind]}, not {what[wanted]}: `fedflat {kind} {name}` runs it")


def packaged_configs() -> Path:
    """The folder of the configs shipped inside the package (the repository's ``configs/`` is a link to it)."""
    return Path(str(resources.files("fedflat") / "configs"))


def packaged_names() -> list[str]:
    """The names of the shipped configs, as ``fedflat run NAME`` takes them: ``fmnist_mlp``,
    ``papers/fedwmsam_table1_fmnist``."""
    return sorted(packaged_name(p) for p in packaged_configs().rglob("*.yaml"))


def packaged_config(name: str | Path) -> Path | None:
    """The shipped config called ``name`` (a ``.yaml`` suffix and a leading ``configs/`` may be given, so the
    repository's paths name them too), or None."""
    key = _shipped_key(name)
    return packaged_configs() / f"{key}.yaml" if key in packaged_names() else None


def _shipped_key(name: str | Path) -> str:
    return Path(name).as_posix().removeprefix("configs/").removesuffix(".yaml")


def packaged_name(path: Path) -> str:
    """The name of a shipped config's file (``papers/fedwmsam_table1_fmnist``)."""
    return path.relative_to(packaged_configs()).with_suffix("").as_posix()


def config_file(path: str | Path, what: str = "config") -> Path:
    """``path`` if it is a file (or ``path.yaml``: a copy made by ``fedflat copy NAME`` is found before the shipped
    NAME), else the shipped config of that name: ``fedflat run fmnist_mlp`` and ``fedflat sweep
    configs/demo_sweep.yaml`` work in any folder once fedflat is installed."""
    path = Path(path)
    with_suffix = [path.with_name(f"{path.name}.yaml")] if path.name and path.suffix != ".yaml" else []
    for candidate in (path, *with_suffix):
        if candidate.is_file():
            return candidate
    shipped = packaged_config(path)
    if shipped is None and path.is_dir():  # (it said "not found")
        raise ConfigError(f"{what} file '{path}' is a folder, not a file: give the path of a YAML file")
    if shipped is None:
        raise ConfigError(f"{what} file '{path}' not found, and no shipped config has that name"
                          f"{suggest(_shipped_key(path), packaged_names())}; "
                          "`fedflat list --configs` lists the shipped ones")
    return shipped


def quickstart_path() -> Path:
    """The embedded quickstart config (digits, Dirichlet split, FedSAM)."""
    return packaged_configs() / "quickstart.yaml"


# -- a run's config from its sources -----------------------------------------------------------------------------------
SHORTHANDS = {"algo": "name", "model": "name", "data.partition": "scheme", "data": "name", "executor": "name"}
RESETTING = {"algo", "model", "data.partition"}  # `algo=X` starts X from its own defaults


def parse_override(text: str) -> tuple[str, Any]:
    """``'a.b=1e-3'`` -> ``('a.b', 0.001)``; values are read as YAML (numbers, lists, booleans)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = read_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_override(tree: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``key`` (dotted) in the raw config tree; ``algo=X`` style shorthands set the name. A flat algorithm
    hyperparameter (``algo.rho``) replaces the value any part holds under that name (a resolved config.yaml
    holds each under its role: ``algo.perturbation.rho``), so the command line wins over the file."""
    if key in SHORTHANDS and not isinstance(value, dict):
        node = _walk(tree, key, create=True)
        if key in RESETTING:
            node.clear()
        node[SHORTHANDS[key]] = value
        return
    *parents, leaf = key.split(".")
    node = _walk(tree, ".".join(parents), create=True) if parents else tree
    if parents == ["algo"] and leaf not in _roles() and leaf != "name":
        for role in _roles():
            if isinstance(node.get(role), dict):
                node[role].pop(leaf, None)
    node[leaf] = value


def _walk(tree: dict[str, Any], dotted: str, create: bool) -> dict[str, Any]:
    node, path = tree, []
    for part in dotted.split("."):
        path.append(part)
        child = node.get(part)
        if child is None and create:
            child = node[part] = _default_subtree(dotted, part, node)
        if isinstance(child, str) and len(path) == 2 and path[0] == "algo" and part in _roles():
            child = node[part] = {"name": child}  # algo.<role>.key on a role given by name
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set a key inside '{dotted}': it is a value, not a section")
        node = child
    return node


def _default_subtree(dotted: str, part: str, node: dict[str, Any]) -> dict[str, Any]:
    """When an override reaches into a section the YAML did not write, start from its defaults."""
    defaults = Config().model_dump()
    path = dotted.split(".")
    cursor: Any = defaults
    for p in path[: path.index(part) + 1]:
        cursor = cursor.get(p, {}) if isinstance(cursor, dict) else {}
    return copy.deepcopy(cursor) if isinstance(cursor, dict) else {}


def located(tree: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``tree`` read from a file in ``folder``: its plugins' paths made absolute (they are relative to the file)."""
    if isinstance(tree.get("plugins"), list):
        tree["plugins"] = plugins.resolve([str(p) for p in tree["plugins"]], base=folder)
    return tree


# --- inheritance: ``base: NAME`` in a run config (docs/experiments.md, "Inheriting a config") -------------------
SECTION_IDS = ("name", "scheme")  # a section naming another method/model/partition starts afresh, as `algo=X` does


def base_file(base: str, referrer: Path) -> Path:
    """The config a ``base:`` names: a file relative to ``referrer``'s folder, else a shipped config by name
    (``fmnist_mlp``, ``papers/fedwmsam_table1_fmnist``)."""
    candidate = (referrer.parent / base).resolve()
    if candidate.is_file():
        return candidate
    shipped = packaged_config(base)
    if shipped is None:
        raise ConfigError(f"{referrer}: base config '{base}' not found (looked at {candidate}, and no shipped config "
                          f"has that name{suggest(_shipped_key(base), packaged_names())}: `fedflat list --configs`)")
    return shipped


def deep_merge(base: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    """``edits`` over ``base``, section by section: a mapping merges into the base's mapping key by key, any other
    value (a list too) replaces; a section that names another method, model or partition (``algo: {name: fedsam}``
    over ``algo: {name: fedavg, ...}``) replaces the base's section, whose keys belong to the other one."""
    merged = copy.deepcopy(base)
    for key, value in edits.items():
        old = merged.get(key)
        switches = isinstance(value, dict) and isinstance(old, dict) and any(
            k in value and k in old and value[k] != old[k] for k in SECTION_IDS)
        if isinstance(value, dict) and isinstance(old, dict) and not switches:
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def inherited(tree: dict[str, Any], file: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A run config read from ``file`` with its ``base:`` resolved: the base config (itself resolved, so bases
    chain) deep-merged with the file's own keys (:func:`deep_merge`). A cycle is refused, naming it."""
    file = file.resolve()
    chain = (*chain, file)
    if "base" not in tree:
        return tree
    edits = {k: v for k, v in tree.items() if k != "base"}
    name = tree["base"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{file}: base must be a config's file or shipped name (got {name!r})")
    parent = base_file(name, file)
    if parent.resolve() in chain:
        cycle = " -> ".join(p.name for p in (*chain[chain.index(parent.resolve()):], parent))
        raise ConfigError(f"{chain[0]}: the configs inherit in a cycle ({cycle}): remove one base")
    loaded = read_yaml_file(parent) or {}
    if not isinstance(loaded, dict) or file_kind(loaded) != "run":
        raise ConfigError(f"{file}: base '{name}' ({parent}) is not one run's config"
                          + (f" but {file_kind(loaded)} file" if isinstance(loaded, dict) else ""))
    return deep_merge(inherited(located(loaded, parent.parent), parent, chain), edits)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None, method: AlgoSpec | None = None) -> "Config":
    """Reads the YAML config ``path`` (a file, or a shipped config's name: ``fmnist_mlp``; None: only ``base``, the
    config tree to start from), applies the ``key=value`` strings of ``overrides``, imports the plugins it names and
    validates (:func:`for_run`); ``method`` is the base's method already built, taken over where the overrides leave
    the ``algo`` section as it is."""
    tree: dict[str, Any] = copy.deepcopy(base) if base else {}
    if path is not None:
        file = config_file(path)
        loaded = read_yaml_file(file) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file}: the top level must be a mapping of keys")
        if file_kind(loaded) != "run":
            raise wrong_kind(path, file_kind(loaded), "run")
        tree = inherited(located(loaded, file.parent), file)
    parsed = [parse_override(item) for item in overrides]
    # Choosing a method (model, partition) comes first, whatever its place on the command line: it starts
    # that section from the chosen one's defaults, and the other overrides then apply to it.
    # A part swapped into a role (algo.filter=fft) comes next: it starts that role from the part's own defaults.
    for key, value in sorted(parsed, key=lambda kv: 0 if _selects(tree, *kv) else 1 if _swaps_part(*kv) else 2):
        if _selects(tree, key, value):
            key = key.rsplit(".", 1)[0] if key not in SHORTHANDS else key
        if key == "plugins" and isinstance(value, list):
            value = plugins.resolve([str(p) for p in value])  # on the command line: relative to the working folder
        apply_override(tree, key, value)
    return for_run(tree, method)


def for_run(tree: dict[str, Any] | Config, method: AlgoSpec | None = None) -> Config:
    """A run's config: the plugins it names imported first (:func:`fedflat.plugins.load`, with those installed through
    the entry-point group: the run builds their parts, models and datasets, and validation finds their names in the
    registries they fill), then the whole validated (:func:`validate`, which has no side effects)."""
    named = tree.plugins if isinstance(tree, Config) else tree.get("plugins")
    plugins.load([str(p) for p in named] if isinstance(named, list) else [])
    return validate(tree, method)


def _roles() -> tuple[str, ...]:
    from fedflat.core.registry import ROLES  # here: importing the config module stays free of torch

    return ROLES


def _swaps_part(key: str, value: Any) -> bool:
    """Whether an override puts another part in one role of the method: ``algo.<role>=NAME``."""
    section, _, role = key.rpartition(".")
    return section == "algo" and role in _roles() and isinstance(value, str)


def _selects(tree: dict[str, Any], key: str, value: Any) -> bool:
    """Whether an override chooses another method/model/partition: ``algo=X``, or ``algo.name=X`` with X not
    the section's current name (so a run's resolved config.yaml never keeps one method's parts under
    another method's name)."""
    if key in RESETTING and not isinstance(value, dict):
        return True
    section, _, leaf = key.rpartition(".")
    if section not in RESETTING or leaf != SHORTHANDS[section]:
        return False
    node = tree
    for part in section.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return not isinstance(node, dict) or node.get(leaf) != value


def as_config(config: Config | dict | str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """A validated :class:`Config` from ``config``: a Config, a raw dict, a YAML path (or a shipped config's name), or
    None (the quickstart); with the ``key=value`` strings of ``overrides`` applied."""
    if isinstance(config, Config):
        return load_config(None, overrides, base=config.model_dump(), method=config.algo) if overrides else \
            for_run(config)
    if isinstance(config, dict):
        return load_config(None, overrides, base=config)
    return load_config(quickstart_path() if config is None else config, overrides)
