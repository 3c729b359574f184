"""Plugins: a researcher's own parts, recipes, models and datasets, used exactly like fedflat's own.

A plugin is a Python module (or package) that registers things when it is imported — ``register_part`` and
``register_recipe`` (:mod:`fedflat.core`), ``register_model`` (:mod:`fedflat.models`), ``register_dataset``
(:mod:`fedflat.data`). It reaches fedflat in one of two ways:

- named in a config, ``plugins: [mylab.methods, ./fedasam.py]``: an importable module name, or the path of a
  ``.py`` file or a package folder (relative to the config file's folder, else the working directory);
- installed with an entry point in the group ``fedflat.plugins`` (``[project.entry-points."fedflat.plugins"]
  fedasam = "fedasam"`` in its pyproject.toml): loaded in every fedflat process, named nowhere.

Every process that builds a method imports the plugins first: the driver when it reads the config, a sweep or tune
worker (a fresh interpreter) when it reads its cell's config, a Ray worker from its :class:`WorkerSpec`, a Flower node
from the app's config. A path plugin's folder is put on ``sys.path`` and on ``PYTHONPATH``, so the processes this one
starts find it too; a Ray cluster on other machines receives it through Ray's ``py_modules``. A plugin that fails to
import, or registers a name fedflat or another plugin registered, is a :class:`PluginError` that names it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from fedflat.core.errors import PluginError

ENTRY_POINT_GROUP = "fedflat.plugins"
_loaded: dict[str, str] = {}  # plugin as named -> the module imported for it
_installed_done = False


def _source(plugin: str, base: Path | None) -> Path | None:
    """The file or package folder a path plugin names, or None for a module name."""
    if not (plugin.endswith(".py") or "/" in plugin or os.sep in plugin or plugin.startswith(".")):
        return None
    for root in (base, Path.cwd()) if base is not None else (Path.cwd(),):
        path = (root / plugin).expanduser()
        if path.exists():
            return path.resolve()
    raise PluginError(f"plugin {plugin!r}: no such file or folder (looked in "
                      f"{', '.join(str(r) for r in ((base, Path.cwd()) if base else (Path.cwd(),)))})")


def _make_importable(folder: Path) -> None:
    """``folder`` on this process's ``sys.path`` and on ``PYTHONPATH`` for the processes it starts."""
    entry = str(folder)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entry not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([entry, *paths])


def resolve(plugins: list[str] | tuple[str, ...], base: str | Path | None = None) -> list[str]:
    """``plugins`` as a config records them: module names as given, paths made absolute (a run folder's
    config.yaml then finds them from anywhere)."""
    out = []
    for plugin in plugins:
        path = _source(plugin, Path(base) if base is not None else None)
        out.append(plugin if path is None else str(path))
    return out


def load(plugins: list[str] | tuple[str, ...], base: str | Path | None = None) -> list[str]:
    """Imports every plugin (once per process), and those installed through the entry-point group; returns the
    modules imported for ``plugins``."""
    load_installed()
    modules = []
    for plugin in plugins:
        if plugin not in _loaded:
            path = _source(plugin, Path(base) if base is not None else None)
            name = plugin
            if path is not None:
                _make_importable(path.parent)
                name = path.stem if path.is_file() else path.name
            _import(plugin, name)
            _loaded[plugin] = name
        modules.append(_loaded[plugin])
    return modules


def not_imported(plugins: list[str] | tuple[str, ...]) -> list[str]:
    """Those of ``plugins`` this process has not imported (:func:`load`)."""
    return [plugin for plugin in plugins if plugin not in _loaded]


def _import(plugin: str, module: str) -> None:
    imported_before = module in sys.modules
    before = _registrations()
    try:
        importlib.import_module(module)
    except PluginError as err:
        raise PluginError(f"plugin {plugin!r}: {err}") from None
    except ModuleNotFoundError as err:
        hint = " (is it installed, or on PYTHONPATH, in this process's environment?)" if err.name else ""
        raise PluginError(f"plugin {plugin!r} failed to import: {type(err).__name__}: {err}{hint}") from err
    except Exception as err:  # whatever the user's module raised: name the plugin, the cause and where
        raise PluginError(f"plugin {plugin!r} failed to import: {type(err).__name__}: {err}{_raised_at(err)}") from err
    if not imported_before and not _registrations() - before:
        raise PluginError(f"plugin {plugin!r} registered nothing: a plugin registers, when imported, its parts and "
                          "recipes (fedflat.core.register_part, register_recipe), models (fedflat.models."
                          "register_model) or datasets (fedflat.data.register_dataset), at module level "
                          "(docs/extending.md#using-a-plugin)")


def _registrations() -> set[tuple[int, str, str]]:
    """What the registries hold from outside fedflat: ``(registry, name, origin)`` (none before any is loaded)."""
    registry = sys.modules.get("fedflat.core.registry")
    if registry is None:
        return set()
    return {(key[0], key[1], origin) for key, origin in registry._ORIGINS.items()
            if not origin.removeprefix("module ").startswith("fedflat.")}


def _raised_at(err: BaseException) -> str:
    """`` (FILE, line N)`` where ``err`` was raised: a SyntaxError's own place, else the traceback's last frame."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" ({err.filename}, line {err.lineno})"
    frames = traceback.extract_tb(err.__traceback__)
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def load_installed() -> None:
    """Imports every plugin installed with an entry point in :data:`ENTRY_POINT_GROUP` (once per process)."""
    global _installed_done
    if _installed_done:
        return
    _installed_done = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except PluginError as err:
            raise PluginError(f"installed plugin {entry.name!r} ({entry.value}): {err}") from None
        except Exception as err:
            raise PluginError(f"installed plugin {entry.name!r} ({entry.value}) failed to import: "
                              f"{type(err).__name__}: {err}") from err


def package_folders(plugins: list[str] | tuple[str, ...]) -> list[str]:
    """The local folders or files of ``plugins`` (path plugins, and named modules found on this machine), for a
    Ray cluster on other machines (``runtime_env={"py_modules": ...}``)."""
    out = []
    for plugin in plugins:
        path = _source(plugin, None)
        if path is None:
            spec = importlib.util.find_spec(plugin.split(".")[0])
            if spec is None or spec.origin is None:
                continue
            origin = Path(spec.origin)
            path = origin.parent if origin.name == "__init__.py" else origin
        out.append(str(path))
    return out
