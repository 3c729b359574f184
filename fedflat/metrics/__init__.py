"""Flatness diagnostics of the seed papers: global sharpness and Hessian spectrum, flatness
incompatibility, direction tracking, perturbation spectra, client and perturbation drift, loss
landscapes, t-SNE and PCA of representations. See docs/diagnostics.md.

Python: ``analyze(kind, open_run(run_dir))``; command line: ``fedflat analyze KIND RUN_DIR``; during
training: ``diagnostics.every=N`` (``diagnostics.kinds=[...]``).
"""
from fedflat.metrics.analysis import KINDS, Target, analyze, open_run
from fedflat.metrics.flatness import flatness_incompatibility, perturbation_drift, perturbation_drift_at
from fedflat.metrics.landscape import filter_normalized_direction, interpolation, landscape_2d, surface
from fedflat.metrics.objective import DataObjective, global_objective, seeded_subset
from fedflat.metrics.sharpness import global_sharpness, sam_sharpness, top_hessian_eigenvalue
from fedflat.metrics.spectra import band_variance, frequency_variance, perturbation_spectra
from fedflat.metrics.tracking import direction_tracking, tracking_error

__all__ = ["DataObjective", "KINDS", "Target", "analyze", "band_variance", "direction_tracking",
           "filter_normalized_direction", "flatness_incompatibility", "frequency_variance", "global_objective",
           "global_sharpness", "interpolation", "landscape_2d", "open_run", "perturbation_drift",
           "perturbation_drift_at", "perturbation_spectra", "sam_sharpness", "seeded_subset", "surface",
           "top_hessian_eigenvalue", "tracking_error"]
