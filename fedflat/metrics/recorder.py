"""Recording diagnostics during training: a runner hook that runs ``diagnostics.kinds`` every
``diagnostics.every`` rounds.

Each recorded kind writes ``RUN_DIR/diagnostics/<kind>-rNNNN.json`` (and figures) and appends the same
document as one line to ``RUN_DIR/diagnostics/<kind>.jsonl``; on evaluated rounds its headline scalars
(``sharpness``, ``hessian_top``, ``flatness_incompatibility``, ``tracking_error``, ...) are added to the
round's metrics line. Diagnostics never change training: they read the state and work on copies
(see :mod:`fedflat.metrics.probe`), and their time is reported as ``diagnostics_seconds``, not training time.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from fedflat.config import DiagnosticsConfig
from fedflat.files import json_safe
from fedflat.metrics.analysis import Target, analyze, headline


def append_line(path: Path, doc: dict[str, Any]) -> None:
    """One complete JSON line, flushed and synced (readers ignore a torn last line)."""
    with open(path, "a") as fh:
        fh.write(json.dumps(json_safe(doc)) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


class DiagnosticsRecorder:
    """``hook(runner, t, record)``: after round ``t``, when ``(t + 1) % every == 0``, records every kind.
    Without a run folder the documents are kept in ``self.documents``."""

    def __init__(self, options: DiagnosticsConfig):
        if options.every < 1:
            raise ValueError("diagnostics.every must be >= 1 to record")
        self.options = options
        self.documents: list[dict[str, Any]] = []

    def __call__(self, runner, t: int, record: dict[str, Any] | None) -> None:
        if (t + 1) % self.options.every:
            return
        start = time.perf_counter()
        path = runner.run_dir.path if runner.run_dir is not None else None
        target = Target(runner.sim, t + 1, path)
        out = path / "diagnostics" if path is not None else None
        scalars: dict[str, Any] = {}
        for kind in self.options.kinds:
            doc = analyze(kind, target, self.options, out, suffix=f"-r{t + 1:04d}")
            self.documents.append(doc)
            if out is not None:
                append_line(out / f"{kind}.jsonl", doc)
            scalars.update(headline(doc))
        if record is not None:
            record.update(scalars, diagnostics_seconds=time.perf_counter() - start)
