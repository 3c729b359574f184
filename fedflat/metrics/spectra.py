"""Perturbation spectra (seed 004, Section 4.1 and Fig. 1): where in frequency clients' SAM perturbations
disagree.

Per parameter tensor ``l``, each client's perturbation segment ``eps_i^l`` (flattened, length ``n_l``) goes
through the orthonormal rFFT ``E_i^l[m]``, ``m = 0 .. floor(n_l/2)``. The inter-client variance at frequency
``m`` is ``var_l[m] = (1/M) sum_i |E_i^l[m] - mean_j E_j^l[m]|^2``. Frequencies are grouped into ``bands``
equal bands of the normalized frequency ``m / (floor(n_l/2) + 1)`` (band 0 holds the lowest, DC included);
a band's value for a layer is the mean variance of its bins, and the figure's value is the mean over
layers (seed 004 "averages these variances across all layers"). The orthonormal transform keeps values of
layers of different sizes comparable (white noise of unit variance has unit variance in every bin).
"""
from __future__ import annotations

from typing import Any

import torch

from fedflat.core import ParamLayout


def frequency_variance(eps: torch.Tensor) -> torch.Tensor:
    """``var[m]`` across the rows of ``eps[M, n]`` of the orthonormal rFFT coefficients, shape ``[n//2 + 1]``."""
    spectrum = torch.fft.rfft(eps.to(torch.float64), dim=-1, norm="ortho")
    return (spectrum - spectrum.mean(dim=0, keepdim=True)).abs().pow(2).mean(dim=0)


def band_of_bins(bins: int, bands: int) -> torch.Tensor:
    """The band index ``floor(bands * m / bins)`` of each frequency bin ``m``."""
    return torch.div(torch.arange(bins) * bands, bins, rounding_mode="floor")


def band_variance(eps: torch.Tensor, layout: ParamLayout, bands: int = 10, min_bins: int | None = None) -> dict[str, Any]:
    """Inter-client variance per frequency band for every tensor of ``layout`` with at least ``min_bins``
    rFFT bins (default ``bands``, so that every band has a bin), and its mean over those tensors."""
    if eps.shape[0] < 2:
        raise ValueError("the inter-client variance needs perturbations of at least 2 clients")
    min_bins = bands if min_bins is None else min_bins
    layers: dict[str, list[float]] = {}
    for name, segment in zip(layout.names, layout.segments(eps)):
        var = frequency_variance(segment)
        if var.numel() < min_bins:
            continue
        index = band_of_bins(var.numel(), bands)
        sums = torch.zeros(bands, dtype=var.dtype).index_add_(0, index, var)
        counts = torch.bincount(index, minlength=bands).to(var.dtype)
        layers[name] = (sums / counts).tolist()
    if not layers:
        raise ValueError(f"no parameter tensor has {min_bins} frequency bins; use fewer bands")
    mean = torch.tensor(list(layers.values()), dtype=torch.float64).mean(dim=0)
    edges = [b / bands for b in range(bands + 1)]
    return {"bands": bands, "band_edges": edges, "variance": mean.tolist(),
            "low_to_high_ratio": (mean[0] / mean[-1]).item() if mean[-1] > 0 else float("inf"),
            "layers": layers}


def perturbation_spectra(sim, round: int, *, clients: int | None = 20, client_samples: int | None = 500,
                         direction: str = "sam", rho: float = 0.05, bands: int = 10) -> dict[str, Any]:
    """Seed 004 Fig. 1 at ``w^t``: clients' perturbations (local SAM by default, or the method's own)
    through the per-layer rFFT, inter-client variance per band averaged over layers."""
    from fedflat.metrics.objective import client_objective, seeded_clients
    from fedflat.metrics.probe import method_perturbations

    ids = seeded_clients(sim, clients)
    objectives = [client_objective(sim, int(i), client_samples) for i in ids]
    pert = method_perturbations(sim, round, ids, objectives, direction, rho)
    rows = pert.available.nonzero().flatten().cpu()
    if len(rows) < 2:
        return {"available": False, "direction": pert.direction,
                "reason": f"fewer than 2 probed clients have a perturbation ({pert.direction}); "
                          "use direction=sam for local SAM perturbations"}
    return {"available": True, "direction": pert.direction, "clients": ids[rows].tolist(),
            "heterogeneity": dict(sim.cfg.data.partition),
            **band_variance(pert.eps[rows].cpu(), sim.model.layout, bands)}
