"""Experiments around the engine: the run loop and its folder (:mod:`fedflat.experiments.runner`, its summary in
:mod:`fedflat.experiments.summary`), resume (:mod:`fedflat.experiments.resume`), sweeps, fair tuning
(:mod:`fedflat.experiments.tune`), reports and plots, and their commands."""
