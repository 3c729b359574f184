"""The diagnostics' figures (matplotlib, Agg backend). Every figure has a fixed pixel size,
``FIGSIZE * DPI`` (no tight bounding box), so reports can lay them out predictably."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Sequence

import numpy as np

FIGSIZE = (6.4, 4.8)
DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_size(path: str | Path) -> tuple[int, int]:
    """``(width, height)`` of a PNG file read from its header."""
    with open(path, "rb") as fh:
        head = fh.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


def _save(fig, path: Path) -> Path:
    import io

    from fedflat.files import atomic_write_bytes

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    _pyplot().close(fig)
    atomic_write_bytes(Path(path), buffer.getvalue())
    return Path(path)


def plot_series(x: Sequence[float], series: dict[str, Sequence[float]], path: Path, *, xlabel: str, ylabel: str,
                title: str, logy: bool = False) -> Path:
    """Curves over rounds (client drift, perturbation drift, recorded diagnostics)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for label, y in series.items():
        ax.plot(x[:len(y)], [np.nan if v is None else v for v in y], marker="o", markersize=3, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _save(fig, path)


def plot_spectra(edges: Sequence[float], curves: dict[str, Sequence[float]], path: Path, *, title: str) -> Path:
    """Seed 004 Fig. 1: inter-client variance per frequency band, one curve per heterogeneity level."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    for label, values in curves.items():
        ax.plot(centres, values, marker="o", label=label)
    ax.set_yscale("log")
    ax.set(xlabel="normalized frequency (band centre; 0 = DC, 1 = Nyquist)",
           ylabel="inter-client variance (mean over layers)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_interpolation(alphas: Sequence[float], loss: Sequence[float], accuracy: Sequence[float], path: Path, *,
                       labels: tuple[str, str], title: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(alphas, loss, color="tab:blue", label="loss")
    ax.set(xlabel=f"alpha  (0: {labels[0]}, 1: {labels[1]})", ylabel="training loss", title=title)
    ax.axvline(0, color="grey", lw=0.8, ls="--")
    ax.axvline(1, color="grey", lw=0.8, ls="--")
    twin = ax.twinx()
    twin.plot(alphas, accuracy, color="tab:red", label="accuracy")
    twin.set_ylabel("training accuracy")
    ax.legend(handles=ax.get_lines()[:1] + twin.get_lines(), loc="upper center")
    return _save(fig, path)


def plot_surface(coords: Sequence[float], loss: Sequence[Sequence[float]], contour_path: Path, surface_path: Path, *,
                 title: str) -> tuple[Path, Path]:
    """Contour and 3-D surface of ``loss[b][a]`` over the direction coefficients ``a`` (x) and ``b`` (y)."""
    plt = _pyplot()
    A, B = np.meshgrid(coords, coords)
    Z = np.asarray(loss, dtype=float)
    fig, ax = plt.subplots(figsize=FIGSIZE)
    levels = np.linspace(np.nanmin(Z), np.nanpercentile(Z, 95), 25)
    filled = ax.contourf(A, B, Z, levels=levels, cmap="viridis", extend="max")
    ax.contour(A, B, Z, levels=levels, colors="white", linewidths=0.4)
    fig.colorbar(filled, ax=ax, label="training loss")
    ax.plot([0], [0], marker="*", color="red", markersize=12)
    ax.set(xlabel="direction 1 (filter-normalized)", ylabel="direction 2 (filter-normalized)", title=title)
    _save(fig, contour_path)
    fig = plt.figure(figsize=FIGSIZE)
    ax = fig.add_subplot(projection="3d")
    ax.plot_surface(A, B, np.minimum(Z, np.nanpercentile(Z, 95)), cmap="viridis", linewidth=0, antialiased=True)
    ax.set(xlabel="direction 1", ylabel="direction 2", zlabel="loss", title=title)
    return Path(contour_path), _save(fig, surface_path)


def plot_embedding(coords: np.ndarray, labels: np.ndarray, path: Path, *, title: str) -> Path:
    """A 2-D embedding coloured by class."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    classes = np.unique(labels)
    cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
    for j, c in enumerate(classes):
        pick = labels == c
        ax.scatter(coords[pick, 0], coords[pick, 1], s=4, color=cmap(j % cmap.N), label=str(c))
    ax.set(title=title, xticks=[], yticks=[])
    if len(classes) <= 20:
        ax.legend(markerscale=3, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), title="class")
    return _save(fig, path)


def plot_groups(groups: dict[str, np.ndarray], path: Path, *, title: str, axis_labels: tuple[str, str]) -> Path:
    """Scatter of 2-D points, one colour per group (seed 004 Fig. 4: FedSAM blue, FedFFT red)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for label, pts in groups.items():
        ax.scatter(pts[:, 0], pts[:, 1], s=18, alpha=0.8, label=label)
    ax.set(xlabel=axis_labels[0], ylabel=axis_labels[1], title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
