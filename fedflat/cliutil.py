"""What every ``fedflat`` subcommand's parser shares: plain help text and argument types."""
from __future__ import annotations

import argparse
import os
import re
import sys


def plain_text(doc: str | None) -> str | None:
    """A docstring as a terminal shows it: reST roles and literals (``x``, :class:`X`, **bold**) unwrapped."""
    if doc is None:
        return None
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "").replace("**", "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their paragraphs; an option's default is shown once, unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" not in text and action.default not in (None, False, [], argparse.SUPPRESS)
                and action.option_strings and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with fedflat's help formatting (subcommands' parsers too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        if "description" in kwargs:
            kwargs["description"] = plain_text(kwargs["description"])
        super().__init__(*args, **kwargs)


def workers_count(text: str) -> int | str:
    """An argparse type: ``auto`` or a whole number >= 1."""
    if text == "auto":
        return text
    try:
        return at_least_one(text)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{err}, or auto (as many cells as fit)") from None


def at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_loggers_option(parser: argparse.ArgumentParser) -> None:
    """``--loggers tensorboard,csv,wandb,mlflow``: the config key ``loggers`` set from the command line."""
    parser.add_argument("--loggers", default=None, metavar="NAME,...",
                        help="also record the config and metrics with these loggers: tensorboard, csv, wandb, mlflow "
                             "(the config key loggers; options: docs/experiments.md, 'Tracking runs')")


def loggers_override(names: str | None) -> list[str]:
    """The ``loggers=[...]`` override of a ``--loggers`` value ([] when none was given)."""
    if names is None:
        return []
    return [f"loggers=[{', '.join(n.strip() for n in names.split(',') if n.strip())}]"]


def _one_stream() -> bool:
    """Whether stdout and stderr are the same file, terminal or pipe (a terminal, ``2>&1``, ``|&``)."""
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # replaced streams (pytest's capture, io.StringIO)
        return sys.stdout is sys.stderr
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino) or (sys.stdout.isatty() and sys.stderr.isatty())


def print_run_folder(run_dir, announced: bool) -> None:
    """The run folder at the end, on stdout for scripts; not again where stdout and stderr are one stream that
    showed it announced on stderr at the start (a terminal, ``2>&1``: it read "run folder:" twice there)."""
    if not (announced and _one_stream()):
        print(f"run folder: {run_dir}")


def print_outcome(history, label: str = "", announced: bool = False) -> int:
    """Prints where a run's folder is (:func:`print_run_folder`), its status and final accuracy; returns the
    command's exit code (0 when the run completed, 3 otherwise)."""
    from fedflat.core.registry import display_label  # (torch: after a run; `fedflat --help` loads none)

    s = history.summary
    print_run_folder(history.run_dir, announced)
    print(f"status: {s['status']}" + (f" ({s['reason']})" if s.get("reason") else ""))
    if s.get(f"final_{evaluated_on(s)}_acc") is not None:
        print(f"{display_label(s['algorithm'])}{label}: {s['rounds']} rounds, {accuracy_text(s)}")
    return 0 if s["status"] in ("completed", "stopped", "budget spent") else 3  # experiments.rundir.SUCCEEDED


def evaluated_on(summary: dict) -> str:
    """``test``, or ``val`` for a run evaluated on a validation split (``data.validation``)."""
    return summary.get("evaluated_on") or "test"


def accuracy_text(summary: dict) -> str:
    """``final test accuracy 0.9100, best 0.9200 (round 40)`` (``validation`` for a validation run,
    ``personalized`` for one that evaluates each client's own model)."""
    split = evaluated_on(summary)
    kind = ("personalized " if summary.get("evaluation") == "personalized" else "") + (
        "validation" if split == "val" else "test")
    text = (f"final {kind} accuracy {summary[f'final_{split}_acc']:.4f}, "
            f"best {summary[f'best_{split}_acc']:.4f} (round {summary['best_round']})")
    if summary.get("selected_test_acc") is not None:  # selected on validation: the number a paper reports
        text += (f"; test accuracy of the selected model ({summary['selected_file']}, round "
                 f"{summary['selected_round']}) {summary['selected_test_acc']:.4f}")
    return text


def split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG.yaml] [key=value ...]``: the first item is a config path unless it has '='."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items
