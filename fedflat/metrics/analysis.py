"""Running a diagnostic on a run and writing what it found: one entry point for ``fedflat analyze`` and for
recording during training.

Every kind writes ``<out>/<kind>.json`` (``<kind>-rNNNN.json`` when recorded at round NNNN, plus one line in
``<kind>.jsonl``) with a stable schema::

    {"kind": ..., "schema": 1, "round": rounds completed, "algorithm": ..., "run": run folder or null,
     "options": {the diagnostics options used}, "result": {...kind-specific, "available": bool...},
     "files": [PNG/CSV files written next to it]}

``result["available"]`` is False, with a ``reason``, when the method lacks the quantity (no global
direction, no perturbation), instead of an error.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fedflat.config import DiagnosticsConfig
from fedflat.files import atomic_write_text, json_safe, read_jsonl
from fedflat.metrics import plots
from fedflat.metrics.flatness import flatness_incompatibility, perturbation_drift_at
from fedflat.metrics.landscape import interpolation, landscape_2d
from fedflat.metrics.objective import global_objective
from fedflat.metrics.representations import client_layer_vectors, pca_2d, penultimate_features, tsne_embedding
from fedflat.metrics.sharpness import global_sharpness
from fedflat.metrics.spectra import perturbation_spectra
from fedflat.metrics.tracking import direction_tracking

SCHEMA = 1
# Options each kind reads (recorded in its JSON so a result says how it was computed).
OPTIONS = {
    "sharpness": ("samples", "rho", "ascent_steps", "hessian_iters"),
    "flatness": ("clients", "client_samples", "samples", "direction", "rho"),
    "drift": ("clients", "client_samples", "samples", "direction", "rho"),
    "tracking": ("reference_batches", "reference_batch_size"),
    "spectra": ("clients", "client_samples", "direction", "rho", "bands"),
    "landscape": ("samples", "span", "resolution"),
    "tsne": ("tsne_samples", "perplexity"),
    "pca": ("clients", "client_samples", "direction", "rho", "layer"),
}
# Scalars a recorded kind adds to the round's metrics line (key in metrics -> key in result).
HEADLINES = {
    "sharpness": {"sharpness": "sharpness", "hessian_top": "hessian_top"},
    "flatness": {"flatness_incompatibility": "incompatibility", "flatness_variance": "variance"},
    "drift": {"perturbation_drift": "perturbation_drift", "perturbation_cosine_distance": "cosine_distance"},
    "tracking": {"tracking_error": "squared_error", "tracking_cosine": "cosine"},
    "spectra": {"spectra_low_high_ratio": "low_to_high_ratio"},
}


@dataclass
class Target:
    """A simulation to analyze: its state after ``round`` completed rounds, and its run folder if any."""

    sim: Any
    round: int
    path: Path | None = None
    note: str | None = None

    @property
    def label(self) -> str:
        return self.path.name if self.path is not None else self.sim.algorithm.name


def open_run(run_dir: str | Path) -> Target:
    """The run folder's simulation restored to its latest state (checkpoint, else model.pt)."""
    from fedflat.engine.checkpoint import load_run

    path = Path(run_dir)
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{path}: not a run folder (no config.yaml)")
    sim = load_run(path)
    rounds = getattr(sim, "rounds_done", None)
    note = None
    if rounds is None:
        summary = path / "summary.json"
        rounds = json.loads(summary.read_text()).get("rounds", 0) if summary.is_file() else 0
        note = ("no checkpoint.pt: the global model comes from model.pt, server and client state start fresh "
                "(global directions and stateful perturbations are those of round 0)")
    return Target(sim, int(rounds), path, note)


def heterogeneity_label(sim) -> str:
    """``dirichlet alpha=0.3``-style label of the run's partition (seed 004 Fig. 1's curves)."""
    part = dict(sim.cfg.data.partition)
    scheme = part.pop("scheme")
    keys = [k for k in ("alpha", "classes_per_client", "shards_per_client") if k in part]
    return scheme + "".join(f" {k}={part[k]}" for k in keys)


def run_labels(targets: list[Target]) -> list[str]:
    """Short distinct legend labels: the algorithm, then with the heterogeneity level, then the folder name."""
    for make in (lambda t: t.sim.algorithm.name, heterogeneity_label,
                 lambda t: f"{t.sim.algorithm.name}, {heterogeneity_label(t.sim)}", lambda t: t.label):
        labels = [make(t) if make is not heterogeneity_label else make(t.sim) for t in targets]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i}: {t.label}" for i, t in enumerate(targets)]


# --- one function per kind: (target, options, out_dir, suffix) -> (result, files) ---------------------------

def _sharpness(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str):
    return global_sharpness(target.sim, rho=o.rho, samples=o.samples, ascent_steps=o.ascent_steps,
                            hessian_iters=o.hessian_iters), []


def _probe_options(o: DiagnosticsConfig) -> dict[str, Any]:
    return dict(clients=o.clients, client_samples=o.client_samples, samples=o.samples, direction=o.direction,
                rho=o.rho)


def _flatness(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str):
    return flatness_incompatibility(target.sim, target.round, **_probe_options(o)), []


def _drift(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str):
    result = perturbation_drift_at(target.sim, target.round, **_probe_options(o))
    files: list[Path] = []
    if target.path is not None:
        metrics = read_jsonl(target.path / "metrics.jsonl")
        rounds = [m["round"] for m in metrics if m.get("drift") is not None]
        drift = [m["drift"] for m in metrics if m.get("drift") is not None]
        result["client_drift"] = {"rounds": rounds, "drift": drift}
        if out is not None and rounds:
            files.append(plots.plot_series(rounds, {target.sim.algorithm.name: drift}, out / f"client_drift{suffix}.png",
                                           xlabel="round", ylabel="mean ||w_i - w^t||",
                                           title=f"client drift of {target.label} (FedSCAM's measure, Sec. 5.5)"))
        history = [d for d in read_jsonl(target.path / "diagnostics" / "drift.jsonl")
                   if d["result"].get("available") and d["round"] != target.round]
        if out is not None and result.get("available") and history:
            xs = [d["round"] for d in history] + [target.round]
            pd = [d["result"]["perturbation_drift"] for d in history] + [result["perturbation_drift"]]
            cd = [d["result"]["cosine_distance"] for d in history] + [result["cosine_distance"]]
            order = np.argsort(xs, kind="stable")
            files.append(plots.plot_series([xs[i] for i in order], {"PD (FedLESAM, Sec. 4.1)": [pd[i] for i in order],
                                                                    "1 - cos": [cd[i] for i in order]},
                                            out / f"perturbation_drift{suffix}.png", xlabel="round",
                                            ylabel="distance to the global perturbation",
                                            title=f"perturbation drift of {target.label} (FedLESAM, Fig. 2)"))
    return result, files


def _tracking(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str):
    return direction_tracking(target.sim, target.round, batches=o.reference_batches,
                              batch_size=o.reference_batch_size), []


def spectra_csv(result: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    layers = list(result["layers"])
    writer.writerow(["band", "low", "high", "variance_mean", *layers])
    edges = result["band_edges"]
    for b in range(result["bands"]):
        writer.writerow([b, edges[b], edges[b + 1], result["variance"][b], *(result["layers"][n][b] for n in layers)])
    return buffer.getvalue()


def _spectra(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str):
    result = perturbation_spectra(target.sim, target.round, clients=o.clients, client_samples=o.client_samples,
                                  direction=o.direction, rho=o.rho, bands=o.bands)
    files: list[Path] = []
    if result["available"]:
        result["label"] = heterogeneity_label(target.sim)
        if out is not None:
            csv_path = out / f"spectra{suffix}.csv"
            atomic_write_text(csv_path, spectra_csv(result))
            files += [csv_path, plots.plot_spectra(result["band_edges"], {result["label"]: result["variance"]},
                                                   out / f"spectra{suffix}.png",
                                                   title=f"{target.sim.algorithm.name}, round {target.round}: "
                                                         "inter-client variance of perturbations")]
    return result, files


def _landscape(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str, other: Target | None = None):
    sim = target.sim
    result = landscape_2d(sim, samples=o.samples, span=o.span, resolution=o.resolution)
    w_a, label_a = ((other.sim.server.w, other.label) if other is not None
                    else (sim.model.initial.to(sim.server.w.device), "initial"))
    label_b = target.label if other is not None else f"round {target.round}"
    alphas = torch.linspace(-0.5, 1.5, 2 * o.resolution - 1)
    result["interpolation"] = {"from": label_a, "to": label_b,
                               **interpolation(global_objective(sim, o.samples), w_a, sim.server.w, alphas)}
    files: list[Path] = []
    if out is not None:
        title = f"{sim.algorithm.name}, round {target.round}"
        files += list(plots.plot_surface(result["coordinates"], result["loss"], out / f"landscape_contour{suffix}.png",
                                         out / f"landscape_surface{suffix}.png", title=title))
        i = result["interpolation"]
        files.append(plots.plot_interpolation(i["alphas"], i["loss"], i["accuracy"], out / f"interpolation{suffix}.png",
                                              labels=(label_a, label_b), title=f"{title}: linear interpolation"))
    return result, files


def _tsne(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str):
    features, labels = penultimate_features(target.sim, samples=o.tsne_samples)
    coords = tsne_embedding(features, target.sim.cfg.seed, o.perplexity)
    result = {"available": True, "samples": int(len(labels)), "feature_dim": int(features.shape[1])}
    files: list[Path] = []
    if out is not None:
        buffer = io.StringIO()
        np.savetxt(buffer, np.column_stack([coords, labels]), delimiter=",", header="x,y,label", comments="",
                   fmt=["%.6f", "%.6f", "%d"])
        atomic_write_text(out / f"tsne{suffix}.csv", buffer.getvalue())
        files += [out / f"tsne{suffix}.csv",
                  plots.plot_embedding(coords, labels, out / f"tsne{suffix}.png",
                                       title=f"t-SNE of penultimate features: {target.sim.algorithm.name}, "
                                             f"round {target.round}")]
    return result, files


def _left_out_note(meta: list[dict[str, Any]], what: str) -> str | None:
    """Why a PCA plot shows fewer points than clients were probed (10 probed, 2 points, and once not a word why)."""
    short = [m for m in meta if len(m["clients"]) < m["probed"]]
    if not short:
        return None
    counts = ", ".join(f"{len(m['clients'])} of {m['probed']}" + (f" ({m['run']})" if len(meta) > 1 else "")
                       for m in short)
    why = ("the others' perturbation is zero at local step 0 (a method whose perturbation needs the client's "
           "earlier rounds, before it has any)" if what == "perturbations" else "the others have none")
    return f"{counts} probed clients shown: {why}"


def _pca(target: Target, o: DiagnosticsConfig, out: Path | None, suffix: str, others: list[Target] = ()):
    """Seed 004 Fig. 4a/4c: clients' perturbations and locally trained parameters of one layer, PCA fitted
    jointly over the runs compared (one colour per run)."""
    result: dict[str, Any] = {"available": True}
    files: list[Path] = []
    labels = run_labels([target, *others])
    for what in ("perturbations", "parameters"):
        groups, meta = {}, []
        for t, label in zip([target, *others], labels):
            got = client_layer_vectors(t.sim, t.round, what=what, layer=o.layer, clients=o.clients,
                                       client_samples=o.client_samples, direction=o.direction, rho=o.rho)
            if len(got["clients"]) >= 2:
                groups[label] = got["vectors"]
            meta.append({"run": t.label, "clients": got["clients"], "probed": got["probed"],
                         "direction": got.get("direction")})
        if not groups:
            result[what] = {"available": False, "reason": "fewer than 2 clients have this quantity"}
            continue
        names = list(groups)
        note = _left_out_note(meta, what)
        coords, ratio = pca_2d(np.concatenate([groups[n] for n in names]))
        split = np.cumsum([len(groups[n]) for n in names])[:-1]
        projected = dict(zip(names, np.split(coords, split)))
        spread = {n: float(np.sqrt(((groups[n] - groups[n].mean(0)) ** 2).sum(1).mean())) for n in names}
        result[what] = {"available": True, "layer": got["layer"], "explained_variance_ratio": ratio,
                        "spread": spread, "runs": meta, "note": note,
                        "coordinates": {n: p.tolist() for n, p in projected.items()}}
        if out is not None:
            title = f"PCA of clients' {what} ({got['layer']}), round {target.round}" + (f"\n{note}" if note else "")
            files.append(plots.plot_groups(projected, out / f"pca_{what}{suffix}.png", title=title,
                                           axis_labels=(f"PC1 ({ratio[0]:.0%})", f"PC2 ({ratio[1]:.0%})"
                                                        if len(ratio) > 1 else "PC2")))
    return result, files


KINDS: dict[str, Callable] = {"sharpness": _sharpness, "flatness": _flatness, "drift": _drift,
                              "tracking": _tracking, "spectra": _spectra, "landscape": _landscape,
                              "tsne": _tsne, "pca": _pca}


def analyze(kind: str, target: Target, options: DiagnosticsConfig | None = None, out: Path | None = None,
            suffix: str = "", **extra) -> dict[str, Any]:
    """Runs diagnostic ``kind`` on ``target`` and, when ``out`` is given, writes ``<kind><suffix>.json`` and
    its figures there. Returns the JSON document."""
    if kind not in KINDS:
        raise ValueError(f"unknown diagnostic '{kind}'; kinds: {', '.join(KINDS)}")
    options = options or target.sim.cfg.diagnostics
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
    result, files = KINDS[kind](target, options, out, suffix, **extra)
    doc = {"kind": kind, "schema": SCHEMA, "round": target.round, "algorithm": target.sim.algorithm.name,
           "run": str(target.path) if target.path is not None else None,
           "options": {k: getattr(options, k) for k in OPTIONS[kind]}, "result": json_safe(_plain(result)),
           "files": [Path(f).name for f in files]}
    if target.note:
        doc["note"] = target.note
    if out is not None:
        atomic_write_text(out / f"{kind}{suffix}.json", json.dumps(doc, indent=1) + "\n")
    return doc


def _plain(value: Any) -> Any:
    """Tensors and NumPy values as JSON numbers and lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def headline(doc: dict[str, Any]) -> dict[str, float]:
    """The scalars of a recorded result that go into the round's metrics line."""
    result = doc["result"]
    if not result.get("available", True):
        return {}
    return {key: result[field] for key, field in HEADLINES.get(doc["kind"], {}).items() if field in result}
