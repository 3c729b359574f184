"""Experiments around the engine: the run loop and its folder (:mod:`fedflat.experiments.runner`), checkpoints
and resume, sweeps, fair tuning (:mod:`fedflat.experiments.tune`), reports and plots, and their commands."""
