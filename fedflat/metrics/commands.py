"""``fedflat analyze KIND RUN_DIR [--compare RUN_DIR ...] [options]``: a diagnostic of a finished (or
checkpointed) run, written to ``RUN_DIR/diagnostics/`` (see docs/diagnostics.md)."""
from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedflat.config import DIAGNOSTIC_KINDS, DiagnosticsConfig
from fedflat.core import ConfigError

_SKIP = ("every", "kinds")


def _value(text: str) -> Any:
    """``all``/``none`` -> None, else a number when it parses as one."""
    if text.lower() in ("all", "none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def register(subparsers) -> None:
    KINDS = DIAGNOSTIC_KINDS  # the same names as fedflat.metrics.analysis.KINDS, without loading it

    p = subparsers.add_parser(
        "analyze", help="flatness diagnostics of a run: " + ", ".join(KINDS),
        description="Runs one diagnostic on a run folder's latest state and writes JSON/CSV/PNG to "
                    "RUN_DIR/diagnostics/. Options default to the run's diagnostics section; "
                    "sizes accept 'all'.")
    p.add_argument("kind", choices=list(KINDS))
    p.add_argument("run_dir")
    p.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR",
                   help="other runs: more curves (spectra), more groups (pca), interpolation start (landscape)")
    p.add_argument("--out", default=None, help="folder for the results (default RUN_DIR/diagnostics)")
    for name, field in DiagnosticsConfig.model_fields.items():
        if name in _SKIP:
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_value, default=argparse.SUPPRESS,
                       help=f"{field.description or name} (default: the run's diagnostics.{name})")
    p.set_defaults(func=cmd_analyze)


def _chosen(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, checked (a bad value is a one-line error naming the option)."""
    chosen = {k: v for k, v in vars(args).items() if k in DiagnosticsConfig.model_fields and k not in _SKIP}
    try:
        DiagnosticsConfig(**chosen)
    except ValidationError as err:
        problems = "; ".join(f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg']} (got {e['input']!r})"
                             for e in err.errors())
        raise ConfigError(f"analyze: {problems}") from None
    return chosen


def _options(target, chosen: dict[str, Any]) -> DiagnosticsConfig:
    return DiagnosticsConfig(**{**target.sim.cfg.diagnostics.model_dump(), **chosen})


def _print(doc: dict[str, Any], out: Path) -> None:
    from fedflat.core.registry import display_label
    from fedflat.metrics.analysis import headline

    result = doc["result"]
    print(f"{doc['kind']} of {display_label(doc['algorithm'])} at round {doc['round']}:")
    if doc.get("note"):
        print(f"  note: {doc['note']}")
    if not result.get("available", True):
        print(f"  not available: {result.get('reason')}")
    for key, value in headline(doc).items():
        print(f"  {key}: {value:.6g}" if isinstance(value, float) else f"  {key}: {value}")
    for key in ("perturbations", "parameters"):
        if isinstance(result.get(key), dict) and result[key].get("available"):
            print(f"  {key}: spread per run {result[key]['spread']}")
    print(f"  written: {out / (doc['kind'] + '.json')}" + "".join(f", {f}" for f in doc["files"]))


def cmd_analyze(args: argparse.Namespace) -> int:
    from fedflat.metrics import plots
    from fedflat.metrics.analysis import analyze, open_run, run_labels

    chosen = _chosen(args)  # before the run is loaded
    target = open_run(args.run_dir)
    options = _options(target, chosen)
    others = [open_run(p) for p in args.compare]
    out = Path(args.out) if args.out else target.path / "diagnostics"
    extra: dict[str, Any] = {}
    if args.kind == "pca":
        extra["others"] = others
    elif args.kind == "landscape" and others:
        extra["other"] = others[0]
    doc = analyze(args.kind, target, options, out, **extra)
    _print(doc, out)
    if args.kind == "spectra" and others:
        docs = [doc] + [analyze("spectra", o, options, Path(args.out) if args.out else o.path / "diagnostics",
                                suffix="" if not args.out else f"-{o.path.name}") for o in others]
        labels = run_labels([target, *others])
        ok = [(label, d) for label, d in zip(labels, docs) if d["result"]["available"]]
        if len(ok) > 1:
            curves = {label: d["result"]["variance"] for label, d in ok}
            ok = [d for _, d in ok]
            png = plots.plot_spectra(ok[0]["result"]["band_edges"], curves, out / "spectra_compare.png",
                                     title="inter-client variance of perturbations by heterogeneity")
            buffer = io.StringIO()
            writer = csv.writer(buffer)
            writer.writerow(["band", "low", "high", *curves])
            edges = ok[0]["result"]["band_edges"]
            for b in range(len(edges) - 1):
                writer.writerow([b, edges[b], edges[b + 1], *(c[b] for c in curves.values())])
            from fedflat.files import atomic_write_text

            atomic_write_text(out / "spectra_compare.csv", buffer.getvalue())
            atomic_write_text(out / "spectra_compare.json", json.dumps({"curves": curves, "band_edges": edges}) + "\n")
            print(f"  comparison: {png}, {out / 'spectra_compare.csv'}")
    return 0
