"""Flatness diagnostics of the seed papers: global sharpness and Hessian spectrum, flatness
incompatibility, direction tracking, perturbation spectra, client and perturbation drift, loss
landscapes, t-SNE and PCA of representations. See docs/diagnostics.md.

Python: ``analyze(kind, open_run(run_dir))``; command line: ``fedflat analyze KIND RUN_DIR``; during
training: ``diagnostics.every=N`` (``diagnostics.kinds=[...]``).
"""
import importlib

_WHERE = {
    "DataObjective": "fedflat.metrics.objective",
    "KINDS": "fedflat.metrics.analysis",
    "Target": "fedflat.metrics.analysis",
    "analyze": "fedflat.metrics.analysis",
    "band_variance": "fedflat.metrics.spectra",
    "direction_tracking": "fedflat.metrics.tracking",
    "filter_normalized_direction": "fedflat.metrics.landscape",
    "flatness_incompatibility": "fedflat.metrics.flatness",
    "frequency_variance": "fedflat.metrics.spectra",
    "global_objective": "fedflat.metrics.objective",
    "global_sharpness": "fedflat.metrics.sharpness",
    "interpolation": "fedflat.metrics.landscape",
    "landscape_2d": "fedflat.metrics.landscape",
    "open_run": "fedflat.metrics.analysis",
    "perturbation_drift": "fedflat.metrics.flatness",
    "perturbation_drift_at": "fedflat.metrics.flatness",
    "perturbation_spectra": "fedflat.metrics.spectra",
    "sam_sharpness": "fedflat.metrics.sharpness",
    "seeded_subset": "fedflat.metrics.objective",
    "surface": "fedflat.metrics.landscape",
    "top_hessian_eigenvalue": "fedflat.metrics.sharpness",
    "tracking_error": "fedflat.metrics.tracking",
}


def __getattr__(name: str):
    """The diagnostics (and torch) load on first use, so the command line's help stays fast."""
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'fedflat.metrics' has no attribute {name!r}")


__all__ = ["DataObjective", "KINDS", "Target", "analyze", "band_variance", "direction_tracking",
           "filter_normalized_direction", "flatness_incompatibility", "frequency_variance", "global_objective",
           "global_sharpness", "interpolation", "landscape_2d", "open_run", "perturbation_drift",
           "perturbation_drift_at", "perturbation_spectra", "sam_sharpness", "seeded_subset", "surface",
           "top_hessian_eigenvalue", "tracking_error"]
