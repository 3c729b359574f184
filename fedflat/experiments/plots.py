"""A report's figures: convergence curves (mean ± std over seeds) per setting, partition heatmaps.

Made for a paper: each figure in PNG (at ``dpi``), PDF and SVG (vector), one column of a two-column paper wide
(3.5 in, 8-point text), methods told apart by colour (Okabe and Ito's colour-blind-safe palette), line style
and marker, and their ±std bands by a light fill edged in the method's own colour and line style.
"""
from __future__ import annotations

import csv
import hashlib
import io
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedflat.experiments.report import Group, Run, ReportError, group_runs
from fedflat.files import atomic_write_bytes

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# Okabe & Ito (2008), "Color Universal Design": told apart with any colour vision deficiency; yellow last (it is
# faint on white)
OKABE_ITO = ("#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")
FORMATS = ("png", "pdf", "svg")
DATA_FORMATS = ("csv",)  # a convergence figure's numbers (round, mean, std per method), beside or instead of it
COLUMN_WIDTH = 3.5  # inches: one column of a two-column paper
DPI = 300
_RC = {"font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "legend.fontsize": 7, "xtick.labelsize": 7,
       "ytick.labelsize": 7, "axes.linewidth": 0.6, "grid.linewidth": 0.4, "lines.linewidth": 1.2,
       "svg.fonttype": "none", "pdf.fonttype": 42}  # text stays text in SVG, TrueType in PDF (editable)


def _slug(text: str, limit: int = 60) -> str:
    """A file-name part for a setting label: ``rounds=8 train.lr=3`` -> ``rounds8_train.lr3``; a label too long
    is cut and keeps a short hash, so two settings never share a file."""
    slug = _UNSAFE.sub("_", text.replace("=", "")).strip("_") or "all"
    if len(slug) <= limit:
        return slug
    return f"{slug[:limit].rstrip('_')}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def curve(runs: list[Run], key: str = "test_acc") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, mean, std)`` of ``key`` over the runs, on the rounds every run evaluated (std with
    ddof=1, zero for a single run)."""
    common = None
    for r in runs:
        rounds = {m["round"] for m in r.metrics if m.get(key) is not None}
        common = rounds if common is None else common & rounds
    rounds = np.array(sorted(common or ()))
    if len(rounds) == 0:
        return rounds, np.array([]), np.array([])
    table = np.array([[next(m[key] for m in r.metrics if m["round"] == t) for t in rounds] for r in runs], dtype=float)
    std = table.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(len(rounds))
    return rounds, table.mean(axis=0), std


def check_figure_options(formats: Sequence[str], dpi: float) -> None:
    """Refuses unknown formats and a resolution that is not positive, before any figure is drawn."""
    unknown = [f for f in formats if f not in FORMATS + DATA_FORMATS]
    if unknown or not formats:
        raise ReportError(f"figure formats: {', '.join(unknown) or 'none given'}; choose among "
                          f"{', '.join(FORMATS + DATA_FORMATS)}")
    if not dpi > 0:
        raise ReportError(f"--dpi must be a positive number of dots per inch (got {dpi:g}); 300 suits print")


def method_style(i: int) -> dict[str, Any]:
    """The ``i``-th method's colour, line style and marker: overlapping methods stay apart, also in grey print."""
    return dict(color=OKABE_ITO[i % len(OKABE_ITO)], linestyle=_STYLES[i % len(_STYLES)],
                marker=_MARKERS[i % len(_MARKERS)], markersize=3)


def save_figure(fig, path: Path, formats: Sequence[str], dpi: float) -> list[Path]:
    """``path`` with each format's suffix, each written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=dpi, metadata={"Date": None} if fmt == "svg" else None)
        target = path.parent / f"{path.name}.{fmt}"  # (not with_suffix: "alpha0.3" has a dot)
        atomic_write_bytes(target, buffer.getvalue())
        written.append(target)
    return written


def write_curves(groups: list[Group], path: Path, key: str = "test_acc") -> Path:
    """The numbers of a convergence figure, ``path`` + ``.csv``: a row per method and evaluated round with the
    mean and std (ddof=1) of ``key`` over the method's runs, as :func:`curve` computes them for the figure."""
    text = io.StringIO()
    rows = csv.writer(text, lineterminator="\n")  # (a method's label may hold commas: quoted)
    rows.writerow(["method", "runs", "round", f"{key}_mean", f"{key}_std"])
    for g in groups:
        rounds, mean, std = curve(g.runs, key)
        rows.writerows([g.method, len(g.runs), t, f"{m:.6g}", f"{s:.6g}"] for t, m, s in zip(rounds, mean, std))
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.parent / f"{path.name}.csv"
    atomic_write_bytes(target, text.getvalue().encode())
    return target


def plot_convergence(groups: list[Group], path: str | Path, title: str, key: str = "test_acc",
                     formats: Sequence[str] = FORMATS, dpi: float = DPI) -> list[Path]:
    """``key`` (test accuracy in %) against rounds, a line per method with a ±std band over seeds, one column
    wide: ``path`` in each of ``formats`` (``csv``: the curves' numbers, :func:`write_curves`)."""
    written = [write_curves(groups, Path(path), key)] if "csv" in formats else []
    formats = [f for f in formats if f in FORMATS]
    if not formats:
        return written
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(COLUMN_WIDTH, 2.6), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        scale = 100.0 if key.endswith("acc") else 1.0
        for i, g in enumerate(groups):
            style = method_style(i)
            rounds, mean, std = curve(g.runs, key)
            if len(rounds) == 0:  # diverged (or stopped) before its first evaluation: named, not silently dropped
                ax.plot([], [], label=f"{g.method} (n={len(g.runs)}): no evaluated round", **style)
                continue
            ax.plot(rounds, scale * mean, label=f"{g.method} (n={len(g.runs)})", markevery=max(1, len(rounds) // 10),
                    zorder=3, **style)
            if len(g.runs) > 1:  # a light fill, edged in the method's colour and style: overlapping bands stay apart
                lo, hi = scale * (mean - std), scale * (mean + std)
                ax.fill_between(rounds, lo, hi, color=style["color"], alpha=0.10, linewidth=0, zorder=1)
                for edge in (lo, hi):
                    ax.plot(rounds, edge, color=style["color"], linestyle=style["linestyle"], linewidth=0.5,
                            alpha=0.6, zorder=2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("communication round")
        ax.set_ylabel("test accuracy (%)" if key == "test_acc" else key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", frameon=True, framealpha=0.85, handlelength=2.6)
        fig.tight_layout(pad=0.3)
        return written + save_figure(fig, Path(path), formats, dpi)


def partition_heatmap(run: Run, path: str | Path, formats: Sequence[str] = FORMATS, dpi: float = DPI) -> list[Path]:
    """The heatmap of the split ``run`` trained on (rebuilt from its config and seed; viridis, which is
    colour-blind safe), ``path`` in each of ``formats`` (its image formats: a split has no curve to write)."""
    import matplotlib

    formats = [f for f in formats if f in FORMATS]
    if not formats:
        return []

    from fedflat.config import as_config
    from fedflat.data import client_split, label_counts, load_dataset, plot_partition
    from fedflat.engine.checkpoint import run_config

    cfg = as_config(run_config(run.path))
    data = load_dataset(cfg.data.name, root=cfg.data.root, download=False, **cfg.data.options)
    labels = data.y_train.cpu().numpy()
    parts = client_split(labels, cfg.data.num_clients, cfg.data.partition, cfg.seed, data.name,
                         owners=data.owners)
    params = {k: v for k, v in cfg.data.partition.items() if k != "scheme"}
    params_text = ", ".join(f"{k}={v}" for k, v in params.items())
    title = (f"{cfg.data.name}, {cfg.data.num_clients} clients, seed {cfg.seed}\n"
             f"{cfg.data.partition['scheme']}({params_text})")
    counts, path = label_counts(labels, parts, data.num_classes), Path(path)
    with matplotlib.rc_context({"savefig.dpi": dpi}):
        return [plot_partition(counts, path.parent / f"{path.name}.{fmt}", title=title) for fmt in formats]


def setting_title(config: dict[str, Any], setting: str) -> str:
    """A convergence figure's title: the dataset and its setting's label, or for the only setting of a report (its
    label is "all": the title read "digits: all") the split and participation that make it."""
    data = config.get("data.name", "")
    if setting != "all":
        return f"{data}: {setting}"
    scheme = config.get("data.partition.scheme", "")
    shape = ", ".join(f"{k.rsplit('.', 1)[1]} {v:g}" for k, v in config.items()
                      if k in ("data.partition.alpha", "data.partition.classes") and isinstance(v, (int, float)))
    return (f"{data}: {config.get('data.num_clients')} clients, {scheme}" + (f" ({shape})" if shape else "")
            + f", {config.get('sampling.clients_per_round')} per round")


def write_plots(runs: list[Run], out_dir: str | Path, key: str = "test_acc", formats: Sequence[str] = FORMATS,
                dpi: float = DPI) -> list[Path]:
    """Per setting: ``convergence-<setting>`` and ``partition-<setting>`` (first seed's split), each in every one
    of ``formats`` (png, pdf, svg), PNG at ``dpi``."""
    check_figure_options(formats, dpi)
    out_dir = Path(out_dir)
    groups = group_runs(runs)
    written: list[Path] = []
    settings: dict[str, list[Group]] = {}
    for g in groups:
        settings.setdefault(g.setting, []).append(g)
    for setting, gs in settings.items():
        title = setting_title(gs[0].runs[0].config, setting)
        if not any(len(curve(g.runs, key)[0]) for g in gs):
            print(f"fedflat report: no convergence plot for '{setting}': no run has an evaluated round")
        else:
            written += plot_convergence(gs, out_dir / f"convergence-{_slug(setting)}", title, key, formats, dpi)
        try:
            written += partition_heatmap(min((r for g in gs for r in g.runs), key=lambda r: r.seed or 0),
                                         out_dir / f"partition-{_slug(setting)}", formats, dpi)
        except Exception as err:  # noqa: BLE001 - a missing dataset must not cost the other figures
            print(f"fedflat report: no partition heatmap for '{setting}': {type(err).__name__}: {err}")
    return written
