"""``fedflat sweep``, ``fedflat tune``, ``fedflat resume``, ``fedflat report`` and ``fedflat evaluate``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedflat.cliutil import add_loggers_option, loggers_override, print_outcome, workers_count
from fedflat.core import ConfigError


def cmd_sweep(args: argparse.Namespace) -> int:
    from fedflat.experiments.sweep import load_sweep, run_sweep

    sweep = load_sweep(args.sweep, variant=args.variant, out=args.out,
                       extra_overrides=[*args.overrides, *loggers_override(args.loggers)])
    cells = sweep.cells()
    if args.dry_run:
        for cell in cells:
            note = f"  INVALID: {cell.error}" if cell.error else ""
            print(f"{sweep.out / cell.name}  {' '.join(cell.as_dict()['overrides'])}{note}")
        print(f"{len(cells)} cells")
        return 0
    ray = _ray_cells(args)
    if ray is not None:
        print(f"sweep folder: {sweep.out} ({len(cells)} cells as Ray tasks of {ray.cpus:g} CPU, {ray.gpus:g} GPU)")
    else:
        print(f"sweep folder: {sweep.out} ({len(cells)} cells, {args.workers} worker(s))")
    result = run_sweep(sweep, workers=args.workers, progress=not args.no_progress, ray=ray)
    counts: dict[str, int] = {}
    for c in result.cells:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    print("cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    for c in result.failed:
        print(f"  failed: {c['name']}: {c.get('reason')}  (see {result.folder / c['name'] / 'error.txt'})")
    print(f"report: fedflat report {result.folder}")
    return 3 if result.failed else 0


def _ray_cells(args: argparse.Namespace):
    from fedflat.experiments.cells import RayCells

    return RayCells(args.ray_address, args.cpus_per_cell, args.gpus_per_cell) if args.backend == "ray" else None


def titled(name: str) -> str:
    """A tune file's method as the tables name it, with the name ``--methods`` takes where they differ:
    ``FedSOL (fedsol)``."""
    from fedflat.core.registry import display_label  # (torch: `fedflat --help` loads none)

    title = display_label(name)
    return name if title == name else f"{title} ({name})"


def cmd_tune(args: argparse.Namespace) -> int:
    from fedflat.experiments.tune import load_study, run_study, selection_table

    only = [name.strip() for name in args.methods.split(",") if name.strip()] if args.methods else None
    study = load_study(args.tune, variant=args.variant, out=args.out,
                       extra_overrides=[*args.overrides, *loggers_override(args.loggers)], only=only)
    trials = study.trial_cells()
    if args.dry_run:
        for name, per in trials.items():
            method = study.methods[name]
            print(f"{titled(name)}: {len(per)} of {method.grid_size} candidates over "
                  + (", ".join(f"{k} {v}" for k, v in method.space.items()) or "nothing (its defaults)"))
            for _, cells in per:
                for cell in cells:
                    print(f"  {study.out / 'trials' / cell.name}" + (f"  INVALID: {cell.error}" if cell.error else ""))
        return 0
    count = sum(len(cells) for per in trials.values() for _, cells in per)
    print(f"tune folder: {study.out} ({len(study.methods)} methods, {count} trial runs on "
          f"{study.validation:g} of the training set held out, then {len(study.final_seeds)} seeds per selection)")
    result = run_study(study, workers=args.workers, progress=not args.no_progress, ray=_ray_cells(args))
    sys.stdout.write(selection_table(result, study))
    for name in result.incomplete:
        print(f"  {titled(name)}: not finished (a trial or final run failed or was interrupted: see its error.txt "
              f"under {study.out}); rerunning the same command resumes it")
    print(f"selections: {study.out / 'tune.json'}; report: fedflat report {study.out / 'final'}")
    return 3 if result.incomplete else 0


def cmd_resume(args: argparse.Namespace) -> int:
    from fedflat.experiments.resume import resume

    history = resume(args.run_dir, overrides=[*args.overrides, *loggers_override(args.loggers)],
                     progress=not args.no_progress)  # errors: cli.main
    return print_outcome(history, announced=not args.no_progress)


def cmd_report(args: argparse.Namespace) -> int:
    from fedflat.experiments.plots import check_figure_options
    from fedflat.experiments.report import ReportError, find_runs, runs_at, table

    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    try:
        if args.plot:
            check_figure_options(formats, args.dpi)  # before the table is written
        runs = find_runs(args.paths)
        if args.at_round is not None:
            runs = runs_at(runs, args.at_round)
        text = table(runs, args.target_acc or [], args.format)
    except ReportError as err:
        print(f"fedflat: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    if args.output:
        from fedflat.files import atomic_write_text

        atomic_write_text(Path(args.output), text)
        print(f"table: {args.output}")
    if args.plot:
        from fedflat.experiments.plots import write_plots

        for path in write_plots(runs, args.plot, formats=formats, dpi=args.dpi):
            print(f"figure: {path}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    import math

    from fedflat.experiments.personal import evaluate_run

    not_a_run(Path(args.run_dir))
    result = evaluate_run(args.run_dir, {"personalized": True, "global": False}.get(args.mode), model=args.model,
                          split=args.split, merged=args.merged)
    split, acc, loss = result["split"], result["accuracy"], result["loss"]
    print(f"{result['model']}, round {result['round']}: {result['evaluation']} {split} accuracy {acc:.4f}, "
          f"loss {loss:.4f}")
    reported, key = result["reported_accuracy"], result["reported_key"]
    if reported is not None:
        # (merged weights W0 + s B A round once more than the adapters' separate products: the loss within 1e-4)
        same = reported == acc and math.isclose(result["reported_loss"] or 0.0, loss,
                                                rel_tol=1e-4 if args.merged else 1e-6)
        print(f"summary.json: {key}_acc {reported:.4f}, {key}_loss {result['reported_loss']:.4f} "
              f"({'reproduced' if same else 'DIFFERENT: the last round was not evaluated, or the files changed'})")
    return 0


def not_a_run(path: Path) -> None:
    """Raises the error that says what ``path`` is when it is not one run's folder (none has ``config.yaml``): a
    sweep's or a tune study's folder, or any folder of runs, with the command that evaluates one of its runs; or a
    folder that holds no run at all."""
    from fedflat.experiments.report import is_run_dir
    from fedflat.experiments.sweep import SWEEP_FILE
    from fedflat.experiments.tune import TUNE_FILE

    if not path.is_dir():
        raise ConfigError(f"{path}: no such run folder (give the folder `fedflat run` printed)")
    if (path / "config.yaml").is_file():
        return
    runs = sorted(d.parent for d in path.rglob("summary.json") if is_run_dir(d.parent))
    what = ("a sweep folder" if (path / SWEEP_FILE).is_file() else "a tune study's folder"
            if (path / TUNE_FILE).is_file() else "a folder of runs" if runs else "not a run folder")
    if not runs:
        raise ConfigError(f"{path} is {what}: it has no config.yaml and no run folder below it (give the folder "
                          "`fedflat run` printed)")
    raise ConfigError(f"{path} is {what}, not one run's folder: evaluate one of its {len(runs)} runs, e.g. "
                      f"`fedflat evaluate {runs[0]}` (`fedflat report {path}` tabulates them all)")


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of experiments (reruns skip finished cells, resume unfinished)")
    p.add_argument("sweep", help="sweep YAML, or a shipped sweep's name (fedflat list --configs; docs/experiments.md)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every cell")
    _cell_options(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("tune", help="tune every method on a validation split with equal budgets, then test the "
                                    "selections over seeds (reruns resume)")
    p.add_argument("tune", help="tune YAML, or a shipped tune file's name (fedflat list --configs)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every trial and final run")
    p.add_argument("--methods", default=None, metavar="A,B,...",
                   help="only these of the file's methods: a group finishes its trials and final runs before the "
                        "next starts (tune.json keeps the other methods' entries)")
    _cell_options(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("resume", help="continue a run folder from its latest checkpoint")
    p.add_argument("run_dir")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="only rounds= (to extend the run), threads=, checkpoint_every=, executor.* and loggers= (a "
                        "change of thread counts may change the last bits: said and recorded)")
    p.add_argument("--no-progress", action="store_true")
    add_loggers_option(p)
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("report", help="paper-style tables (and --plot figures) of run or sweep folders")
    p.add_argument("paths", nargs="+", metavar="RUN_DIR_OR_SWEEP")
    p.add_argument("--target-acc", type=float, nargs="*", default=[], metavar="X",
                   help="target test accuracies as fractions, e.g. 0.7 0.75")
    p.add_argument("--format", default="markdown", help="markdown | csv | latex")
    p.add_argument("--at-round", type=int, default=None, metavar="R",
                   help="the runs as they stood after round R (final accuracy there, best up to it); runs "
                        "that did not evaluate round R are left out")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write convergence curves and partition heatmaps (one column of a paper wide)")
    p.add_argument("--formats", default="png,pdf,svg", metavar="F,...", help="figure formats (png,pdf,svg; csv: each convergence figure's numbers)")
    p.add_argument("--dpi", type=float, default=300, help="the PNG figures' resolution (default 300)")
    p.add_argument("--output", "-o", default=None, help="also write the table to this file")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("evaluate", help="evaluate a run folder's saved models as the run did (a personalized run: "
                                        "model.pt with each client's personal part, personal.pt); it rebuilds the "
                                        "run's model and data, so it imports the plugins its config.yaml names")
    p.add_argument("run_dir")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--personalized", dest="mode", action="store_const", const="personalized",
                      help="each client's own model on its own test share (the default for a personalized run)")
    mode.add_argument("--global", dest="mode", action="store_const", const="global",
                      help="the model file alone on the whole held-out set")
    p.add_argument("--model", default="model.pt", metavar="FILE",
                   help="the model file of the run folder to evaluate: model.pt (default), or one the run kept, "
                        "e.g. best_model.pt (callbacks: model_checkpoint)")
    p.add_argument("--split", default=None, choices=("test", "val"),
                   help="the held-out set (default: the run's); test on a run that selected on a validation split "
                        "gives the selected model's test accuracy, the number a paper reports")
    p.add_argument("--merged", action="store_true",
                   help="a run of adapters (LoRA): evaluate the plain model with its adapters merged into the base "
                        "(W0 + alpha/r B A), as a deployment serves it")
    p.set_defaults(func=cmd_evaluate, mode=None)


def _cell_options(p) -> None:
    """Where and how the cells of a sweep or a tune run: processes or Ray, the file's variant and folder."""
    p.add_argument("--workers", type=workers_count, default=1,
                   help="cells run at once, each in its own process; auto: one a core on CPU, on a GPU as many as "
                        "its memory holds, measured on the first cell (docs/experiments.md, \"Packing a sweep\")")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="ray: every cell a Ray task on a cluster (docs/distributed.md)")
    p.add_argument("--ray-address", default=None, help="with --backend ray: auto or HOST:PORT (default: a local Ray)")
    p.add_argument("--cpus-per-cell", type=float, default=1.0, help="with --backend ray: CPUs per cell (default 1)")
    p.add_argument("--gpus-per-cell", type=float, default=0.0,
                   help="with --backend ray: GPUs per cell, fractions share a GPU (default 0)")
    p.add_argument("--variant", default=None, help="a variant of the file, e.g. small")
    p.add_argument("--out", default=None, help="the output folder (default: the file's 'out')")
    p.add_argument("--dry-run", action="store_true", help="list the cells and their folders, run nothing")
    p.add_argument("--no-progress", action="store_true")
    add_loggers_option(p)
