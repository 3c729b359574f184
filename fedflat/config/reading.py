"""Reading a config's YAML: numbers as a researcher writes them, a file's kind, the configs shipped in the package."""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fedflat.config.schema import suggest
from fedflat.core.errors import ConfigError


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
