"""PNG figures of a report: convergence curves (mean ± std over seeds) per setting, partition heatmaps."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from fedflat.experiments.report import Group, Run, group_runs

_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


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


def plot_convergence(groups: list[Group], path: str | Path, title: str, key: str = "test_acc") -> Path:
    """One PNG: ``key`` (test accuracy in %) against rounds, a line per method, a ±std band over seeds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    scale = 100.0 if key.endswith("acc") else 1.0
    for i, g in enumerate(groups):
        # line style and marker as well as colour: methods that overlap stay distinguishable (and in grey print)
        style = dict(linestyle=_STYLES[i % len(_STYLES)], marker=_MARKERS[i % len(_MARKERS)], markersize=4,
                     linewidth=1.5)
        rounds, mean, std = curve(g.runs, key)
        if len(rounds) == 0:  # diverged (or stopped) before its first evaluation: named, not silently dropped
            ax.plot([], [], label=f"{g.method} (n={len(g.runs)}): no evaluated round", **style)
            continue
        (line,) = ax.plot(rounds, scale * mean, label=f"{g.method} (n={len(g.runs)})",
                          markevery=max(1, len(rounds) // 12), **style)
        if len(g.runs) > 1:
            ax.fill_between(rounds, scale * (mean - std), scale * (mean + std), color=line.get_color(), alpha=0.12,
                            linewidth=0)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("communication round")
    ax.set_ylabel("test accuracy (%)" if key == "test_acc" else key)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def partition_heatmap(run: Run, path: str | Path) -> Path:
    """The heatmap of the split ``run`` trained on (rebuilt from its config and seed)."""
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
    return plot_partition(label_counts(labels, parts, data.num_classes), path, title=title)


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


def write_plots(runs: list[Run], out_dir: str | Path, key: str = "test_acc") -> list[Path]:
    """Per setting: ``convergence-<setting>.png`` and ``partition-<setting>.png`` (first seed's split)."""
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
            written.append(plot_convergence(gs, out_dir / f"convergence-{_slug(setting)}.png", title, key))
        try:
            written.append(partition_heatmap(min((r for g in gs for r in g.runs), key=lambda r: r.seed or 0),
                                             out_dir / f"partition-{_slug(setting)}.png"))
        except Exception as err:  # noqa: BLE001 - a missing dataset must not cost the other figures
            print(f"fedflat report: no partition heatmap for '{setting}': {type(err).__name__}: {err}")
    return written
