"""Sphinx configuration of fedflat's site: README, the pages of docs/ and the API reference from the docstrings.

``make docs`` builds it into docs/_build/html; tests/test_docs.py builds it with warnings as errors."""
from __future__ import annotations

import re

import fedflat

project = "fedflat"
author = "the fedflat authors"
copyright = "2026, the fedflat authors"
release = version = fedflat.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.viewcode"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# Markdown pages as GitHub shows them: heading anchors for `page.md#section` links.
myst_heading_anchors = 4

# The reference: one page per module (autosummary), every public member with its docstring (reST, as written).
autosummary_generate = True
autosummary_imported_members = False
# A package's page documents what it defines and lists its modules; a name it re-exports is documented once, in the
# module that defines it (no duplicate descriptions, no ambiguous links). Registries' values are not printed.
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True, "ignore-module-all": True,
                           "no-value": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
add_module_names = False

html_theme = "alabaster"
html_title = f"fedflat {release}"
html_theme_options = {"description": "Federated learning with sharpness-aware minimization, side by side.",
                      "fixed_sidebar": True, "show_relbars": True}
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}


def _defining_name(target: str) -> str | None:
    """``fedflat.data.Dataset`` -> ``fedflat.data.dataset.Dataset``: where a re-exported name is defined (and so
    documented), or None."""
    import importlib

    module, _, rest = target.partition(".")
    obj = importlib.import_module(module)
    for part in rest.split(".") if rest else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except (ImportError, AttributeError):
                return None
    home, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{home}.{qualname}" if home and qualname and f"{home}.{qualname}" != target else None


def _follow_reexport(app, env, node, contnode):
    """A docstring's ``:class:`fedflat.core.Part``` names the public, re-exported path: link it to the page of
    the module that defines the object."""
    if node.get("refdomain") != "py" or not node.get("reftarget", "").startswith("fedflat."):
        return None
    try:
        target = _defining_name(node["reftarget"])
    except ImportError:
        return None
    if target is None:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], target, node, contnode)


# A link of the README to a repository file (not a docs/ page, which the include's :relative-docs: handles, nor a URL)
REPOSITORY_LINK = re.compile(r"\]\((?!docs/|[a-z]+:|#)([^)\s]+)\)")


def _readme_links(app, relative_path, parent_docname, content):
    """The start page includes the README from docs/: its links to repository files (examples/...) are made
    relative to docs/, so the site carries those files as downloads."""
    if relative_path.name == "README.md":
        content[0] = REPOSITORY_LINK.sub(r"](../\1)", content[0])


def setup(app):
    app.connect("missing-reference", _follow_reexport)
    app.connect("include-read", _readme_links)
