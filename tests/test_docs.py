"""The documentation site (`make docs`): README, docs/ and the API reference from the docstrings build with warnings
as errors, the reference covers every module, and a headless Chromium finds the pages' headings."""
from __future__ import annotations

import functools
import http.server
import json
import pkgutil
import re
import shutil
import subprocess
import sys
import threading
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin

import pytest

import fedflat

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built (as `make docs` does, warnings as errors) from a copy of docs/, examples/ and README, so the
    build's generated pages and caches stay out of the working tree."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed: `make setup` installs the docs extra")
    pytest.importorskip("myst_parser", reason="myst-parser is not installed: `make setup` installs the docs extra")
    source = tmp_path_factory.mktemp("docs-source")
    shutil.copy(REPO / "README.md", source / "README.md")
    shutil.copytree(REPO / "docs", source / "docs", ignore=shutil.ignore_patterns("_build", "generated"))
    shutil.copytree(REPO / "examples", source / "examples", ignore=shutil.ignore_patterns("__pycache__", "runs"))
    out = source / "html"
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
                           str(source / "docs"), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not done.stderr.strip(), f"the site has warnings:\n{done.stderr[-5000:]}"
    return out


@pytest.mark.slow  # the site's Sphinx build: ~75 s, shared by the site's tests (moved from make test: its 10 minutes)
def test_the_site_builds_without_warnings_and_holds_every_page(site):
    pages = {p.stem for p in (REPO / "docs").glob("*.md")} - {"index"}
    assert pages and all((site / f"{page}.html").is_file() for page in pages)
    assert (site / "reference" / "api.html").is_file()


# The pages a reader of a clone opens: README, docs/ and the harness's README under benchmarks/ (not the site's build).
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*") if p.suffix in (".md", ".rst")
                                      and "_build" not in p.parts and "generated" not in p.parts),
         *sorted((REPO / "benchmarks").rglob("*.md"))]
# "issue 12", "issues 42-47", "Issue #5": the history of the work belongs in git, not in what a researcher reads
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
# "seed 004": the project's own numbering of the five papers; a page names the paper (the FedFFT paper)
SEED_PAPER = re.compile(r"\bseed 00\d\b|\bseed papers?\b")
# A path in a link, in backquotes, or in the text when it starts at a top-level folder of the repository
LINK = re.compile(r"\]\(([^)\s]+)\)")
QUOTED = re.compile(r"`([^`\s]+/[^`\s]*)`")
FOLDERS = "|".join(re.escape(p.name) for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("."))
BARE = re.compile(r"(?<![\w/.-])((?:\.\./|shared/)[\w./*-]+|(?:" + FOLDERS + r"|\.ci)/[\w./*-]*[\w*/])")
# Paths the pages name in the authors' repositories (FedACG's code: github.com/geehokim/FedACG), and what a command
# writes (the site, runs); a capitalized component (FILE, NAME, run_X) is a placeholder.
FOREIGN = {"configs/client/ACG.yaml", "configs/config.yaml"}
WRITTEN = ("docs/_build", "runs/")


def named_paths(text: str) -> list[tuple[str, bool]]:
    """``(path, is_link)`` for every path a page names: link targets (relative to the page), backquoted paths and
    bare ones that start at a top-level folder (relative to the repository)."""
    found = [(m.group(1), True) for m in LINK.finditer(text)]
    found += [(m.group(1), False) for m in QUOTED.finditer(text)]
    found += [(m.group(1), False) for m in BARE.finditer(text)]
    kept = []
    for path, is_link in found:
        if "://" in path or path.startswith(("#", "mailto:", "/", "~", "$")) or "@" in path:
            continue
        path = re.sub(r"(::\S*|#\S*|:[\d, -]+)$", "", path).rstrip(".,;:")
        if path and (is_link or path.split("/")[0] in TOP or path.startswith(("../", "shared/"))):
            kept.append((path, is_link))
    return kept


TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"}


def missing_path(page: Path, path: str, is_link: bool) -> str | None:
    """Why ``path`` (named on ``page``) is not a file or folder of the repository, or None if it is."""
    if path in FOREIGN or path.startswith(WRITTEN) or re.search(r"(^|/)[A-Z][A-Z_]*[\w.]*$|_X\b|<", path):
        return None
    # a link, and a path that climbs out of the page's folder (a literalinclude of ../examples/x.py), are the page's
    target = ((page.parent if is_link or path.startswith("../") else REPO) / path).resolve()
    if not target.is_relative_to(REPO):
        return "outside the repository"
    if "*" in path or "{" in path:
        return None if list(REPO.glob(path.split("{")[0])) else "matches no file"
    if target.exists() or any(p.name.startswith(target.name + ".") for p in target.parent.glob("*")):
        return None  # (or the prefix of files a command writes: docs/figures/gpu_converge -> .png, .csv)
    return "no such file or folder in the repository"


def test_the_pages_name_no_issue_and_no_path_a_clone_lacks():
    """README and docs/ are read in a fresh clone: a page names no issue of the project's tracker (say what the thing
    is; its history is in git), and every path it names — a link, `a/path`, docs/x.md — exists in the clone."""
    if not (REPO / ".git").exists():  # (an sdist holds docs/ and tests/, not configs/, scripts/ or benchmarks/)
        pytest.skip("the pages name the paths of a clone of the repository: run this test in one")
    problems = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(REPO)
        problems += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: names {m.group(0)!r}"
                     for m in (*ISSUE.finditer(text), *SEED_PAPER.finditer(text))]
        problems += [f"{name}: {path}: {why}" for path, is_link in named_paths(text)
                     if (why := missing_path(page, path, is_link))]
    assert not problems, "\n".join(problems)


def test_the_path_check_catches_what_it_is_for():
    """The check above on pages that break it: a path outside the repository, a missing one, an issue."""
    page = REPO / "docs" / "x.md"
    assert missing_path(REPO / "README.md", "../shared/anchors/setup.sh", False) == "outside the repository"
    assert missing_path(page, "../shared/anchors/setup.sh", False) == "no such file or folder in the repository"
    assert missing_path(page, "../examples/own_data.py", False) is None
    assert missing_path(page, "../../elsewhere.md", True) == "outside the repository"
    assert missing_path(page, "shared/spec/algorithms.md", False) == "no such file or folder in the repository"
    assert missing_path(page, "benchmarks/anchors/setup.sh", False) is None
    assert missing_path(page, "extending.md", True) is None and missing_path(page, "gone.md", True)
    assert [p for p, _ in named_paths("run `bash ../shared/anchors/run.sh 11 3` or see docs/gone.md, [x](y.md#z)")] \
        == ["y.md", "../shared/anchors/run.sh", "docs/gone.md"]
    assert ISSUE.search("fixed in issue 45") and ISSUE.search("Issues 42-47") and not ISSUE.search("tissue 4")


def test_the_reference_and_the_shipped_configs_name_no_issue():
    """The API reference is made of the package's docstrings, and `fedflat list --configs` shows the configs' first
    comments: neither names an issue either."""
    found = [f"{p.relative_to(REPO)}:{n}" for p in sorted((REPO / "fedflat").rglob("*"))
             if p.suffix in (".py", ".yaml") for n, line in enumerate(p.read_text().splitlines(), 1)
             if ISSUE.search(line)]
    assert not found, found


# The packages a researcher imports from (README "Python API", docs/data.md, docs/extending.md): each public name's
# docstring says what every parameter is.
PUBLIC = ("fedflat", "fedflat.api", "fedflat.data", "fedflat.models", "fedflat.privacy", "fedflat.testing")


def public_callables() -> dict[str, object]:
    """``{"fedflat.data.Dataset.from_torch": function, ...}``: the functions of :data:`PUBLIC`'s ``__all__`` (a
    module without one: the public functions it defines), and the public methods and constructors of its
    classes (their own, not inherited)."""
    import importlib
    import inspect

    found: dict[str, object] = {}
    for package in PUBLIC:
        module = importlib.import_module(package)
        names = getattr(module, "__all__", None) or [n for n, v in vars(module).items() if not n.startswith("_")
                                                     and getattr(v, "__module__", None) == package]
        for name in names:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                found[f"{package}.{name}"] = obj
            elif inspect.isclass(obj) and obj.__module__.startswith("fedflat") and not _is_protocol(obj):
                for attr, value in vars(obj).items():
                    function = getattr(value, "__func__", value)
                    if inspect.isfunction(function) and (attr == "__init__" or not attr.startswith("_")):
                        found[f"{package}.{name}.{attr}"] = (obj, function) if attr == "__init__" else function
    return found


def _is_protocol(cls: type) -> bool:
    """A ``typing.Protocol`` describes what fedflat reads of an object: it has no constructor of its own."""
    return bool(getattr(cls, "_is_protocol", False))


def unnamed_parameters(obj) -> list[str]:
    """The parameters of a function (a constructor: with its class's docstring) its docstring does not name."""
    import inspect

    cls, function = obj if isinstance(obj, tuple) else (None, obj)
    text = " ".join(filter(None, (inspect.getdoc(cls) if cls else None, inspect.getdoc(function))))
    return [p for p in inspect.signature(function).parameters if p not in ("self", "cls")
            and not re.search(rf"(?<![\w]){re.escape(p)}(?![\w])", text)]


def test_the_public_api_docstrings_name_every_parameter():
    """The reference listed ``Dataset.from_torch``'s parameters without ``train``, ``test`` and ``cache``: every
    parameter of the public API is named in its docstring (docs/conf.py then lists each, with its type)."""
    missing = {name: unnamed for name, obj in public_callables().items() if (unnamed := unnamed_parameters(obj))}
    assert not missing, "\n".join(f"{name}: {', '.join(params)}" for name, params in sorted(missing.items()))
    assert "fedflat.data.Dataset.from_torch" in public_callables() and "fedflat.run" in public_callables()


def test_the_data_page_says_where_fashion_mnist_is_read_from():
    """docs/data.md said nothing of Fashion-MNIST: it names Debian's package and folder, and the folders fedflat
    searches (fedflat/data/sources.py), each dataset subfolder, in the order the code tries them."""
    from fedflat.data.sources import SUBFOLDERS, SYSTEM_DIRS

    text = (REPO / "docs" / "data.md").read_text()
    assert "dataset-fashion-mnist" in text and f"`{SYSTEM_DIRS['fmnist'][0]}/`" in text
    order = [text.index(place) for place in ("1. `data.root`", "2. each folder of `$FEDFLAT_DATA`",
                                             "3. the download cache", "4. for Fashion-MNIST only")]
    assert order == sorted(order)
    named = [text.index(f"`{sub}/`") for sub in SUBFOLDERS["fmnist"]]
    assert named == sorted(named), "the subfolders in the order candidate_dirs tries them"


def make_recipe(target: str) -> list[str]:
    """The command lines of ``target``'s recipe in the Makefile (``$(BIN)/`` left out, ``@`` dropped)."""
    lines, inside = [], False
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith(f"{target}:"):
            inside = True
        elif inside and line.startswith("\t"):
            lines.append(line[1:].lstrip("@").replace("$(BIN)/", ""))
        elif inside and line.strip():
            break
    return lines


def test_make_docs_shows_its_progress(tmp_path):
    """`make docs` printed nothing for 2.5 minutes (sphinx -q): it says what it builds, and the build it runs,
    with the Makefile's own options, reports each phase and page as it goes."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed: `make setup` installs the docs extra")
    recipe = make_recipe("docs")
    assert any(line.startswith("echo ") for line in recipe[:-1])  # a line before the long build
    (build,) = [line for line in recipe if " -m sphinx " in line]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "conf.py").write_text('project = "p"\n')
    (tmp_path / "docs" / "index.rst").write_text("Title\n=====\n\ntext\n")
    args = build.split()
    done = subprocess.run([sys.executable, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "reading sources" in done.stdout and "writing output" in done.stdout, done.stdout


def modules() -> list[str]:
    """Every module of the package but ``fedflat`` itself (its names are the Python API page)."""
    root = Path(fedflat.__file__).parent
    names = {".".join(("fedflat", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
             for p in root.rglob("*.py") if p.name not in ("__main__.py", "_version.py")}
    return sorted(names - {"fedflat"})


def listed() -> list[str]:
    """The modules and packages docs/reference/index.rst lists (a package brings its modules)."""
    return [line.strip() for line in (REPO / "docs/reference/index.rst").read_text().splitlines()
            if line.strip().startswith("fedflat.")]


def test_the_reference_lists_every_module():
    """A new module must fall under a listed package or be added to docs/reference/index.rst."""
    packages = {m.name for m in pkgutil.walk_packages([str(Path(fedflat.__file__).parent)], "fedflat.") if m.ispkg}
    uncovered = [m for m in modules() if not any(m == entry or (entry in packages and m.startswith(entry + "."))
                                                 for entry in listed())]
    assert not uncovered, f"modules missing from docs/reference/index.rst: {uncovered}"


@pytest.mark.slow  # the site's build (moved from make test: its 10 minutes)
def test_the_reference_lists_every_parameter_of_a_function(site):
    """``Dataset.from_torch``'s "Parameters" list missed ``train``, ``test`` and ``cache`` (no type hint, no field):
    every parameter is listed, in the signature's order (docs/conf.py: parameter_fields)."""
    import inspect

    from fedflat.data import Dataset

    page = (site / "reference" / "generated" / "fedflat.data.dataset.html").read_text()
    for method in ("from_torch", "from_hf", "from_memmap"):
        entry = page[page.index(f'id="fedflat.data.dataset.Dataset.{method}"'):]
        fields = entry[entry.index("Parameters"):entry.index("</ul>")]
        listed = re.findall(r"<strong>(\w+)</strong>", fields)
        assert listed == [p for p in inspect.signature(getattr(Dataset, method)).parameters], (method, listed)


@pytest.mark.slow  # the site's build (moved from make test: its 10 minutes)
def test_every_module_has_its_page(site):
    missing = [m for m in modules() if not (site / "reference" / "generated" / f"{m}.html").is_file()]
    assert not missing and "fedflat.core.part" in modules()


class Page(HTMLParser):
    """The headings (h1-h3) of a page's main part (not its sidebar), its links and object descriptions (``dt``, by
    id), as the browser left its DOM."""

    def __init__(self, html: str):
        super().__init__()
        self.headings: list[tuple[str, str]] = []
        self.links: dict[str, str] = {}
        self.ids: dict[str, str] = {}
        self.terms: list[str] = []
        self._open: list[tuple[str, str | None, list[str]]] = []
        self._main = 0  # depth inside the element with role="main" (the theme's <article>, or a <div>)
        self._main_tag: str | None = None
        self.html = html  # the DOM as the browser left it (MathJax's output included)
        self.images: list[str] = []  # the main part's <img> sources
        self.feed(html)
        measured = re.search(r'<pre id="fedflat-math">(.*?)</pre>', html, flags=re.S)
        # what MEASURE found: one dict a formula (text, display, width, column); None on a page not measured
        self.math: list[dict] | None = json.loads(unescape(measured.group(1))) if measured else None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if not self._main and attrs.get("role") == "main":
            self._main_tag = tag
        if tag == self._main_tag and (self._main or attrs.get("role") == "main"):
            self._main += 1
        if tag == "img" and self._main:
            self.images.append(attrs.get("src") or "")
        if tag in ("a", "dt") or (tag in ("h1", "h2", "h3") and self._main):
            key = attrs.get("href") if tag == "a" else attrs.get("id")
            self._open.append((tag, key, []))

    def handle_endtag(self, tag):
        if tag == self._main_tag and self._main:
            self._main -= 1
        if self._open and self._open[-1][0] == tag:
            tag, key, parts = self._open.pop()
            text = " ".join("".join(parts).split()).replace("¶", "").replace("#", "").strip()
            if tag.startswith("h"):
                self.headings.append((tag, text))
            elif tag == "a" and key:
                self.links.setdefault(text, key)
            elif tag == "dt":
                self.terms.append(text)
                if key:
                    self.ids[key] = text
            if self._open:  # a link's text is part of its heading's
                self._open[-1][2].append(" ".join(parts))

    def handle_data(self, data):
        if self._open:
            self._open[-1][2].append(data)


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory):
    """``open(path) -> Page``: the page served by a local HTTP server on 127.0.0.1 and loaded by headless Chromium
    (its DOM after the page's scripts ran)."""
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it as root)")
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    profile = tmp_path_factory.mktemp("chromium-profile")

    def open_page(path: str, measure: bool = False) -> Page:
        """The page as Chromium left it in a 1280 x 1000 window; ``measure``: a copy of the page beside it with
        :data:`MEASURE` at its end, so that its ``Page.math`` holds what MathJax drew."""
        if measure:
            original = site / path
            path = str(Path(path).with_name(f"_measured_{original.name}"))
            (site / path).write_text(original.read_text().replace("</body>", MEASURE + "</body>"))
        done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                               "--disable-background-networking", "--disable-component-update", "--disable-sync",
                               "--no-first-run", f"--user-data-dir={profile}", "--window-size=1280,1000",
                               "--virtual-time-budget=10000", "--dump-dom", urljoin(base, path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "<html" in done.stdout, done.stderr[-3000:]
        return Page(done.stdout)

    yield open_page
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


# Run in the page once MathJax has typeset it: every formula's text as MathJax read it (its assistive MathML, which
# holds a literal backslash where TeX was shown rather than typeset, as \text{local\_epochs} was), and for each
# displayed one its width against the main column's. The JSON goes into the DOM, which Chromium dumps.
MEASURE = """<script>
window.addEventListener("load", () => MathJax.startup.promise.then(() => {
  const column = document.querySelector('[role="main"]').getBoundingClientRect().width;
  const math = [...document.querySelectorAll("mjx-container")].map(c => ({
    text: (c.querySelector("mjx-assistive-mml") || c).textContent,
    display: c.getAttribute("display") === "true",
    width: c.querySelector("mjx-math").getBoundingClientRect().width, column: column}));
  const out = document.createElement("pre");
  out.id = "fedflat-math";
  out.textContent = JSON.stringify(math);
  document.body.appendChild(out);
}));
</script>"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.slow  # the site's build and a browser (moved from make test: its 10 minutes)
def test_a_browser_finds_the_start_page_and_the_reference_of_fedflat_run(browser):
    start = browser("index.html")
    assert start.headings[0] == ("h1", "fedflat")
    assert {"Two commands", "Running experiments", "Python API"} <= {text for tag, text in start.headings
                                                                     if tag == "h2"}
    # from the start page's navigation to the reference, and from there to the page of fedflat.run
    reference = browser(start.links["API reference"])
    assert reference.headings[0] == ("h1", "API reference")
    api_href = urljoin(start.links["API reference"], reference.links["Python API: fedflat.run"])
    api = browser(api_href)
    assert api.headings[0] == ("h1", "Python API: fedflat.run")
    assert api.ids["fedflat.run"].startswith("run(config=None, *, overrides=(), dataset=None")
    assert any(term.startswith("class History") for term in api.terms)
    core = browser(urljoin(api_href, "generated/fedflat.core.html"))
    assert core.headings[0] == ("h1", "fedflat.core")
    part = browser(urljoin(api_href, "generated/fedflat.core.part.html"))
    assert "fedflat.core.part.Part" in part.ids and "fedflat.core.part.Perturbation" in part.ids


@pytest.mark.slow  # the site's build and a browser (moved from make test: its 10 minutes)
def test_the_site_search_finds_a_function(browser):
    results = browser("search.html?q=load_sweep")
    assert any(text.startswith("fedflat.experiments.sweep.load_sweep") for text in results.links), \
        sorted(results.links)[:20]


@pytest.mark.slow  # the site's build (moved from make test: its 10 minutes)
def test_a_reexported_name_is_found_under_its_package(site):
    """``fedflat.data.Dataset`` (defined in fedflat.data.dataset) is in the search index and on the package's page,
    with a link to its description."""
    import json
    import re

    text = (site / "searchindex.js").read_text()
    index = json.loads(text[text.index("(") + 1:text.rindex(")")])
    assert any(entry[-1] == "Dataset" for entry in index["objects"]["fedflat.data"])
    page = (site / "reference" / "generated" / "fedflat.data.html").read_text()
    assert 'id="fedflat.data.Dataset"' in page
    assert re.search(r'href="fedflat\.data\.dataset\.html#fedflat\.data\.dataset\.Dataset"', page)


@pytest.mark.slow  # the site's build (moved from make test: its 10 minutes)
def test_every_docs_back_link_of_a_source_page_points_at_an_anchor_that_exists(site):
    """sphinx.ext.viewcode's "[docs]" links pointed at ``#fedflat.History`` on the runner's page, which has only
    ``#fedflat.experiments.runner.History`` (docs/conf.py: _viewcode_backlinks)."""
    import re
    from urllib.parse import unquote

    ids: dict[Path, set[str]] = {}
    broken, count = [], 0
    for page in (site / "_modules").rglob("*.html"):
        for href in re.findall(r'<a class="viewcode-back" href="([^"]+)"', page.read_text()):
            count += 1
            target, _, anchor = href.partition("#")
            path = (page.parent / target).resolve()
            if path not in ids:
                ids[path] = set(re.findall(r'id="([^"]+)"', path.read_text())) if path.is_file() else set()
            if unquote(anchor) not in ids[path]:
                broken.append(f"{page.relative_to(site)}: {href}")
    assert count > 500 and not broken, broken[:10]


@pytest.mark.slow  # the site's build and a browser (moved from make test: its 10 minutes)
def test_a_browser_shows_every_formula_typeset_within_the_column_and_the_lists_as_lists(browser):
    """What a reader saw go wrong: `\\text{local\\_epochs}` drawn with its backslash, the shared local step's
    equation wider than the text column (cut off, or scrolled), and privacy.md's "3. adaptive clip" run into the
    paragraph before it. In a 1280-pixel window every formula of algorithms.md and privacy.md is typeset without a
    backslash left over, every displayed one fits the main column, and the mechanism's three steps are one list."""
    math = {name: browser(name, measure=True).math for name in ("algorithms.html", "privacy.html")}
    for name, formulas in math.items():
        assert formulas and any(m["display"] for m in formulas) == (name == "algorithms.html"), name
        assert not [m["text"] for m in formulas if "\\" in m["text"]], name
        # (a pixel of slack: the layout's widths are fractional)
        wide = [f'{m["width"]:.0f} px > {m["column"]:.0f} px: {m["text"][:60]}' for m in formulas
                if m["display"] and m["width"] > m["column"] + 1]
        assert not wide, (name, wide)
    step = [m for m in math["algorithms.html"] if m["text"].startswith("ϵ=filter(perturbation)")]
    assert len(step) == 1 and step[0]["display"], "the shared local step is one displayed equation"
    assert any("local_epochs" in m["text"] for m in math["algorithms.html"])
    privacy = browser("privacy.html").html
    mechanism = re.search(r"<ol[^>]*>(.*?)</ol>", privacy[privacy.index('id="the-mechanism"'):], flags=re.S).group(1)
    items = [" ".join(re.sub(r"<[^>]+>", " ", item).split()) for item in re.findall(r"<li>(.*?)</li>", mechanism, re.S)]
    assert [item[:len(step)] for item, step in zip(items, ("clip", "noise", "adaptive clip"))] == \
        ["clip", "noise", "adaptive clip"] and len(items) == 3, items


@pytest.mark.slow  # the site's build and a browser (moved from make test: its 10 minutes)
def test_a_browser_shows_the_equations_as_math_and_the_architecture_diagrams(browser, site):
    """The site once showed ASCII equations (`eps = rho g / ||g||`) in a theme that cut long code lines, and the
    architecture page had no picture. The pages' $...$ math is typeset by MathJax (served by the site itself: its
    output elements are in the DOM after the scripts ran), and architecture.md shows both diagrams."""
    algorithms = browser("algorithms.html")
    assert algorithms.html.count("<mjx-container") > 20, "MathJax typeset nothing on algorithms.html"
    assert "\\lVert" not in algorithms.html.split("<mjx-container", 1)[1][:2000]  # typeset, not left as source
    for page in ("privacy.html", "security.html"):
        assert "<mjx-container" in browser(page).html, page
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()  # no network needed
    architecture = browser("architecture.html")
    shown = {Path(src).name for src in architecture.images}
    assert {"layers.svg", "round.svg"} <= shown, shown
    for name in ("layers.svg", "round.svg"):
        (found,) = [p for p in site.rglob(name)]
        assert "<svg" in found.read_text()
    assert "furo" in (site / "index.html").read_text()  # the theme
