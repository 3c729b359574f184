"""Sphinx configuration of fedflat's site: README, the pages of docs/ and the API reference from the docstrings.

``make docs`` builds it into docs/_build/html; tests/test_docs.py builds it with warnings as errors."""
from __future__ import annotations

import importlib
import inspect
import re

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.domains import ObjType
from sphinx.domains.python import PyObject, PythonDomain
from sphinx.util.docutils import SphinxDirective

import fedflat

project = "fedflat"
author = "the fedflat authors"
copyright = "2026, the fedflat authors"
release = version = fedflat.__version__

# Equations as the papers write them: $...$ and $$...$$ (MyST's dollarmath, amsmath's environments), rendered by
# MathJax 3 from the site itself (sphinx-mathjax-offline: the site needs no network to show them).
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.viewcode", "sphinx.ext.mathjax",
              "sphinx-mathjax-offline"]
myst_enable_extensions = ["dollarmath", "amsmath"]
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
# module that defines it (no duplicate descriptions), and listed on the package's page under the package's name
# (`.. reexports::`, below: a search for fedflat.data.Dataset finds it). Registries' values are not printed.
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True, "ignore-module-all": True,
                           "no-value": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
add_module_names = False

html_theme = "furo"
html_title = f"fedflat {release}"
html_static_path = ["_static"]
html_css_files = ["fedflat.css"]  # long code lines wrap instead of hiding in a scrolling box


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


ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?(?:[^`<]*<)?([^`>]+)>?`")


def _summary(obj) -> str:
    """The first paragraph of ``obj``'s docstring as plain text (its roles as their targets' names), every mark
    reST would read escaped."""
    first = (inspect.getdoc(obj) or "").split("\n\n", 1)[0]
    text = ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], " ".join(first.split())).replace("`", "")
    return re.sub(r"([^A-Za-z0-9\s])", r"\\\1", text)


def reexported(package: str) -> list[tuple[str, object, str]]:
    """``(name, object, defining path)`` of each class and function a package's ``__all__`` re-exports from
    another module (a module's own names are documented by its automodule; a name that is also a submodule's,
    as ``fedflat.data.partition``, is the submodule's)."""
    import pkgutil

    module = importlib.import_module(package)
    if not hasattr(module, "__path__"):
        return []
    submodules = {m.name for m in pkgutil.iter_modules(module.__path__)}
    found = []
    for name in getattr(module, "__all__", ()):
        if name in submodules:
            continue
        obj = getattr(module, name, None)
        home, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and home and qualname and home != package:
            found.append((name, obj, f"{home}.{qualname}"))
    return found


class PyReexport(PyObject):
    """``.. py:reexport:: Dataset`` (``:module: fedflat.data``, ``:kind: class``): a name a package re-exports. Its
    own object type, which only ``:obj:`` finds, so a class reference (a type hint's ``Dataset``) still resolves,
    unambiguously, to the class's description in its defining module."""

    option_spec = {**PyObject.option_spec, "kind": directives.unchanged}

    def get_signature_prefix(self, sig: str) -> list[nodes.Node]:
        kind = self.options.get("kind")
        return [addnodes.desc_sig_keyword("", kind), addnodes.desc_sig_space()] if kind else []

    def get_index_text(self, modname: str, name_cls: tuple[str, str]) -> str:
        return f"{name_cls[0]} (re-exported in {modname})"


class ReExports(SphinxDirective):
    """``.. reexports:: fedflat.data``: each public name the package re-exports, under the package's name, with
    its summary and a link to its description in the module that defines it."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        package = self.arguments[0]
        entries = reexported(package)
        if not entries:
            return []
        lines = [".. rubric:: Re-exported names", "",
                 f"Imported from ``{package}``; each is described in the module that defines it.", ""]
        for name, obj, home in entries:
            kind = ("exception" if inspect.isclass(obj) and issubclass(obj, BaseException)
                    else "class" if inspect.isclass(obj) else "function")
            role = "exc" if kind == "exception" else "class" if kind == "class" else "func"
            text = " ".join(filter(None, (_summary(obj), f"Described at :py:{role}:`{home}`.")))
            lines += [f".. py:reexport:: {name}", f"   :module: {package}", f"   :kind: {kind}", "", f"   {text}", ""]
        holder = nodes.container()
        self.state.nested_parse(StringList(lines, source=f"<reexports of {package}>"), self.content_offset, holder)
        return holder.children


# ":param x:", ":param int x:", ":param \*args:": the name a field documents
PARAM_FIELD = re.compile(r"^:param\s+(?:[^\s:]+\s+)?(?:\\?\*){0,2}(\w+):", flags=re.M)


def parameter_fields(obj, lines: list[str]) -> list[str]:
    """``:param NAME:`` fields for each parameter of ``obj``'s signature (``self`` and ``cls`` aside) that its
    docstring ``lines`` have no field for, in the signature's order.

    With ``autodoc_typehints = "description"`` Sphinx lists a parameter under "Parameters" only if it has a type hint
    or a field: ``Dataset.from_torch(train, test, ..., cache=None)`` showed neither ``train``, ``test`` nor
    ``cache``. With a field for each, the list names every parameter, in order, and Sphinx adds the type of each
    annotated one; the docstring's text says what each is."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    fielded = set(PARAM_FIELD.findall("\n".join(lines)))
    stars = {inspect.Parameter.VAR_POSITIONAL: "\\*", inspect.Parameter.VAR_KEYWORD: "\\*\\*"}
    return [f":param {stars.get(p.kind, '')}{p.name}:" for p in signature.parameters.values()
            if p.name not in ("self", "cls") and p.name not in fielded]


def _every_parameter(app, what, name, obj, options, lines):
    """autodoc-process-docstring: a function's or method's docstring gains the fields of :func:`parameter_fields`."""
    if what in ("function", "method") and callable(obj):
        fields = parameter_fields(obj, lines)
        if fields:
            lines.extend(["", *fields] if lines and lines[-1].strip() else fields)


def _viewcode_backlinks(app):
    """A source page's "[docs]" links, made by sphinx.ext.viewcode as ``#<module where it first met the name>.<name>``
    on the page that documented the name last: for a name also shown under a package or on the Python API page
    (``fedflat.History``), an anchor that page does not have. Each link is pointed at the name's description in
    its defining module (dropped, rather than broken, if it has none). Runs before viewcode writes the pages."""
    env, domain = app.env, app.env.get_domain("py")
    for modname, entry in getattr(env, "_viewcode_modules", {}).items():
        if not entry:
            continue
        code, tags, used, _first = entry
        for name in list(used):
            found = domain.objects.get(f"{modname}.{name}")
            if found is None or found.aliased or found.node_id != f"{modname}.{name}":
                del used[name]
            else:
                used[name] = found.docname
        env._viewcode_modules[modname] = (code, tags, used, modname)
    return []


def setup(app):
    app.connect("missing-reference", _follow_reexport)
    app.connect("autodoc-process-docstring", _every_parameter)
    app.connect("include-read", _readme_links)
    PythonDomain.object_types.setdefault("reexport", ObjType("re-exported name", "obj"))
    app.add_directive_to_domain("py", "reexport", PyReexport)
    app.add_directive("reexports", ReExports)
    app.connect("html-collect-pages", _viewcode_backlinks, priority=400)
