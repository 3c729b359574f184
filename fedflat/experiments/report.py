"""Paper-style tables from run folders: per method and setting, accuracy as mean ± std over seeds,
rounds and time to target accuracies, seconds per round, communication and backprops.

Runs are grouped automatically: the *method* is the ``algo`` section, the *setting* everything else
that differs between the runs found (partition, model, rounds, ...), and the seeds of one method in
one setting are its repetitions. Labels show only what varies, as a paper's table does.

Conventions (stated in every table's caption of docs/experiments.md):

- accuracies are test accuracy in percent; ``mean ± std`` uses the sample standard deviation
  (``ddof=1``) over seeds; one seed shows the mean alone;
- *rounds to X* is the first evaluated round with test accuracy ≥ X, averaged over the seeds that
  reached it (``(k/n)`` when only ``k`` of ``n`` did), and "–" when none did, as in the papers;
- *time to X* is the cumulative local-training + aggregation time (``train_seconds``, evaluation
  excluded) at that round; *s/round* is ``train_seconds / rounds``;
- *comm* is the model-sized vectors a sampled client exchanges per round (up + down) relative to
  FedAvg's 2, so it is also the ratio of total communication for an equal number of rounds and clients;
- where the runs' federated vectors differ in size (low-rank adapters beside full models), *trainable params* is
  the size of ``w`` (``summary.json``'s ``parameters``) and *up (KB/client/round)* what a sampled client uploads in
  a round, as encoded (the mean of the metrics lines' ``up_bytes``, in units of 1,000 bytes).
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from fedflat.algorithms.compose import scoped_section
from fedflat.core import ROLES, composition_label
from fedflat.core.registry import display_label
from fedflat.files import read_jsonl

DASH = "–"
# Keys that never define a setting: bookkeeping and execution details that do not change results
# (or change them only by floating-point order: engine and device are shown in the summary instead).
IGNORED_KEYS = ("seed", "name", "out", "device", "engine", "threads", "chunk_size", "checkpoint_every",
                "tensorboard", "loggers", "eval.batch_size", "data.root", "data.download", "store.")


class ReportError(ValueError):
    """Nothing to report (no run folders found) or a bad report option."""


@dataclass
class Run:
    """One run folder read back: flat config, summary, metrics lines."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    def rounds_to(self, target: float) -> tuple[int, float] | None:
        """``(round, train_seconds)`` of the first evaluation with ``test_acc >= target``, or None."""
        for m in self.metrics:
            if m.get("test_acc") is not None and m["test_acc"] >= target:
                return m["round"], m.get("train_seconds") or 0.0
        return None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return out


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() and (path / "config.yaml").is_file()


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run folder at or below ``paths`` (run folders, sweep folders, any parent folder)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ReportError(f"{p}: no such folder")
        if is_run_dir(p):
            found.append(p)
        else:
            found.extend(sorted(d.parent for d in p.rglob("summary.json") if is_run_dir(d.parent)))
    runs, seen = [], set()
    for path in found:
        key = path.resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            run = read_run(path)
        except (OSError, ValueError, yaml.YAMLError) as err:  # one unreadable folder must not hide the others
            # (one line: a YAML error's own text spans several, with the offending line quoted)
            said = " ".join(str(err).split("\n")[0].split()) or type(err).__name__
            warn(f"skipped {path}: {said}")
            continue
        runs.append(run)
    if not runs:
        raise ReportError(f"no run folders (with summary.json and config.yaml) under {', '.join(map(str, paths))}")
    return runs


def warn(message: str) -> None:
    print(f"fedflat report: warning: {message}", file=sys.stderr)


def read_run(path: Path) -> Run:
    """A run folder read back; a corrupt file is an error naming it. Metrics whose rounds repeat or go back
    (two writers in one folder) mark the run's summary ``corrupt`` instead of passing for a clean run."""
    config = yaml.safe_load((path / "config.yaml").read_text())
    if not isinstance(config, dict):
        raise ValueError("config.yaml is not a mapping of keys")
    if isinstance(config.get("algo"), dict):  # a run written before hyperparameters were scoped reads as it ran
        config["algo"] = scoped_section(config["algo"])
    try:
        summary = json.loads((path / "summary.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"summary.json is not valid JSON ({err})") from None
    try:
        metrics = read_jsonl(path / "metrics.jsonl")
    except json.JSONDecodeError as err:
        raise ValueError(f"metrics.jsonl has a line that is not JSON ({err})") from None
    rounds = [m.get("round") for m in metrics]
    if any(not isinstance(r, int) for r in rounds) or any(b <= a for a, b in zip(rounds, rounds[1:])):
        summary = {**summary, "status": "corrupt",
                   "reason": "metrics.jsonl has repeated or out-of-order rounds (two writers?)"}
        warn(f"{path}: metrics.jsonl has repeated or out-of-order rounds; reported as corrupt")
    return Run(path=path, config=flatten(config), summary=summary, metrics=metrics)


def at_round(run: Run, round: int) -> Run | None:
    """``run`` as it stood after ``round`` rounds: its metrics up to that round, final accuracy there, best
    accuracy up to it, training time then — or None when it did not evaluate that round. Runs planned for
    different lengths compare at a common round this way (the papers report round 500 of longer runs too)."""
    kept = [m for m in run.metrics if m["round"] <= round]
    if not kept or kept[-1]["round"] != round or kept[-1].get("test_acc") is None:
        return None
    accuracies = [m["test_acc"] for m in kept if m.get("test_acc") is not None]
    status = run.summary.get("status") if run.summary.get("status") == "corrupt" else "completed"
    extra = {f"final_{k}": v for k, v in kept[-1].items() if k.startswith("test_") and k not in ("test_acc", "test_loss")}
    summary = {**run.summary, **extra, "status": status, "rounds": round, "final_test_acc": kept[-1]["test_acc"],
               "final_test_loss": kept[-1].get("test_loss"), "best_test_acc": max(accuracies),
               "train_seconds": kept[-1].get("train_seconds")}
    return Run(path=run.path, config={**run.config, "rounds": round}, summary=summary, metrics=kept)


def runs_at(runs: list[Run], round: int) -> list[Run]:
    """The runs that evaluated ``round``, each as it stood then (:func:`at_round`); the others are left out
    with a warning, and none at all is an error."""
    if round < 1:
        raise ReportError(f"--at-round {round}: give a round of 1 or more")
    cut = []
    for run in runs:
        then = at_round(run, round)
        if then is None:
            last = max((m["round"] for m in run.metrics if m.get("test_acc") is not None), default=0)
            warn(f"left out {run.path}: it did not evaluate round {round} (its last evaluation: round {last})")
        else:
            cut.append(then)
    if not cut:
        raise ReportError(f"no run evaluated round {round} (evaluations are every eval.every rounds)")
    return cut


def _ignored(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in IGNORED_KEYS)


def _fmt_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _label(items: list[tuple[str, Any]]) -> str:
    """``value`` for names, ``key=value`` otherwise, the key by its last part (``algo.perturbation.rho``: ``rho``)
    unless two of ``items`` share it (then ``perturbation.rho``)."""
    leaves = [key.rsplit(".", 1)[-1] for key, _ in items]
    parts = []
    for (key, value), leaf in zip(items, leaves):
        shown = leaf if leaves.count(leaf) == 1 else ".".join(key.split(".")[-2:])
        parts.append(_fmt_value(value) if leaf in ("name", "scheme") else f"{shown}={_fmt_value(value)}")
    return ", ".join(parts)


def _varying(dicts: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for d in dicts:
        keys.extend(k for k in d if k not in keys)
    return [k for k in keys if len({repr(d.get(k)) for d in dicts}) > 1]


@dataclass
class Group:
    """The seeds of one method in one setting."""

    setting: str
    method: str
    runs: list[Run] = field(default_factory=list)


def _method_name(flat_algo: dict[str, Any]) -> str:
    """The method a run trained: its recipe name, or the composition when its roles were swapped."""
    if not flat_algo:
        return "?"
    section = {role: flat_algo[f"algo.{role}.name"] for role in ROLES if f"algo.{role}.name" in flat_algo}
    return composition_label({"name": flat_algo.get("algo.name"), **section})


def group_runs(runs: list[Run]) -> list[Group]:
    """Groups runs by (setting, method); labels name only the keys that vary across ``runs``."""
    method_part = [{k: v for k, v in r.config.items() if k.startswith("algo.")} for r in runs]
    setting_part = [{k: v for k, v in r.config.items() if not k.startswith("algo.") and not _ignored(k)}
                    for r in runs]
    setting_keys = _varying(setting_part)
    # a method's label: its name plus the hyperparameters that differ between runs of the same name
    by_name: dict[str, list[dict[str, Any]]] = {}
    for m in method_part:
        by_name.setdefault(_method_name(m), []).append(m)
    roles = {f"algo.{role}.name" for role in ROLES}
    method_keys = {name: [k for k in _varying(ms) if k != "algo.name" and k not in roles]
                   for name, ms in by_name.items()}
    groups: dict[tuple[str, str], Group] = {}
    for run, m, s in zip(runs, method_part, setting_part):
        name = _method_name(m)
        extra = _label([(k, m.get(k)) for k in method_keys[name]])
        method = f"{display_label(name)} ({extra})" if extra else display_label(name)  # as the papers write it
        setting = _label([(k, s.get(k)) for k in setting_keys if k in s]) or "all"
        groups.setdefault((setting, method), Group(setting, method)).runs.append(run)
    ordered = sorted(groups.values(), key=lambda g: (g.setting, g.method != display_label("fedavg"), g.method))
    return ordered


def at_chance(acc: float, num_classes: int, count: int) -> bool:
    """Whether accuracy ``acc`` on ``count`` held-out samples is at chance level: within three binomial standard
    errors of ``p = 1/num_classes``, ``|acc - p| <= 3 sqrt(p (1 - p) / count)``. A model that guesses (or, on a
    balanced held-out set, predicts one class) scores ``p`` up to that sampling error; one that learned anything
    beyond it is more than 3 standard errors away (0.009 on Fashion-MNIST's 10,000 test images)."""
    p = 1.0 / num_classes
    return count > 0 and abs(acc - p) <= 3.0 * math.sqrt(p * (1.0 - p) / count)


def run_status(run: Run) -> str:
    """The run's ``status``, or ``at chance`` for a completed run whose final accuracy on its held-out split is at
    chance level (:func:`at_chance`; a run that did not record its held-out size and classes cannot tell)."""
    status, s = run.summary.get("status", "?"), run.summary
    split = s.get("evaluated_on", "test")
    acc, count, classes = s.get(f"final_{split}_acc"), s.get(f"{split}_samples"), s.get("num_classes")
    if status == "completed" and None not in (acc, count, classes) and at_chance(acc, classes, count):
        return "at chance"
    return status


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (``ddof=1``; None for fewer than two values)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass
class Row:
    """One table row: numbers (for CSV) and their formatted strings (Markdown/LaTeX)."""

    setting: str
    method: str
    seeds: int
    final: tuple[float | None, float | None]
    best: tuple[float | None, float | None]
    targets: dict[float, tuple[float | None, float | None, int]]  # target -> (rounds, seconds, reached)
    sec_per_round: float | None
    comm: float | None
    backprops: float | None
    rounds: float | None
    status: str
    epsilon: float | None = None  # privacy spent (mean over seeds), for runs under differential privacy
    metrics: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # eval.metrics, in %
    # runs that selected on a validation split: the test accuracy of the model each selected (in %)
    selected: tuple[float | None, float | None] = (None, None)
    radius: str | None = None  # the SAM radius the runs perturbed with (``rho=0.05``; None: no perturbation)
    parameters: float | None = None  # the federated (trainable) parameters, the size of w
    up_bytes: float | None = None  # bytes a sampled client uploads a round, as encoded
    seed_values: tuple[Any, ...] = ()  # the runs' seeds, in order
    # (dataset, split, samples) of each held-out split the runs' accuracies are on: what one sample is worth
    heldout: tuple[tuple[str, str, int], ...] = ()


def summarize(group: Group, targets: list[float]) -> Row:
    runs = group.runs
    pct = [100 * r.summary["final_test_acc"] if r.summary.get("final_test_acc") is not None else None for r in runs]
    best = [100 * r.summary["best_test_acc"] if r.summary.get("best_test_acc") is not None else None for r in runs]
    hits: dict[float, tuple[float | None, float | None, int]] = {}
    for target in targets:
        reached = [h for h in (r.rounds_to(target) for r in runs) if h is not None]
        if reached:
            hits[target] = (mean_std([float(h[0]) for h in reached])[0], mean_std([h[1] for h in reached])[0],
                            len(reached))
        else:
            hits[target] = (None, None, 0)
    per_round = [r.summary["train_seconds"] / r.summary["rounds"] for r in runs
                 if r.summary.get("rounds") and r.summary.get("train_seconds") is not None]
    comm = [(r.summary["up_vectors"] + r.summary["down_vectors"]) / 2 for r in runs
            if r.summary.get("up_vectors") is not None and r.summary.get("down_vectors") is not None]
    bp = [r.summary["backprops_per_step"] for r in runs if r.summary.get("backprops_per_step") is not None]
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[run_status(r)] = statuses.get(run_status(r), 0) + 1
    status = ", ".join(f"{k} {v}/{len(runs)}" for k, v in statuses.items() if k != "completed") or "ok"
    # a personalized run's accuracy is its clients' own models on their own test shares, not the global model's
    personalized = any(r.summary.get("evaluation") == "personalized" for r in runs)
    return Row(setting=group.setting, method=group.method + (" (personalized eval)" if personalized else ""),
               seeds=len(runs), final=mean_std(pct), best=mean_std(best),
               targets=hits, sec_per_round=mean_std(per_round)[0], comm=mean_std(comm)[0], backprops=mean_std(bp)[0],
               rounds=mean_std([float(r.summary.get("rounds") or 0) for r in runs])[0], status=status,
               epsilon=mean_std([r.summary["epsilon"] for r in runs if r.summary.get("epsilon") is not None])[0],
               metrics={name: mean_std([100 * r.summary[f"final_test_{name}"] for r in runs
                                        if r.summary.get(f"final_test_{name}") is not None])
                        for name in _metric_names(runs)},
               selected=mean_std([100 * r.summary["selected_test_acc"] for r in runs
                                  if r.summary.get("selected_test_acc") is not None]),
               radius=radius_of(runs),
               parameters=mean_std([r.summary.get("parameters") for r in runs])[0],
               up_bytes=mean_std([upload_bytes(r) for r in runs])[0],
               seed_values=tuple(sorted({r.seed for r in runs}, key=_seed_order)), heldout=heldout_of(runs))


def upload_bytes(run: Run) -> float | None:
    """Bytes a sampled client uploaded a round, as encoded: the mean of the metrics lines' ``up_bytes``."""
    per_round = [m["up_bytes"] for m in run.metrics if m.get("up_bytes") is not None]
    return sum(per_round) / len(per_round) if per_round else None


def heldout_of(runs: list[Run]) -> tuple[tuple[str, str, int], ...]:
    """``(dataset, split, samples)`` for each held-out split the runs recorded (``test_samples``, and
    ``val_samples`` for runs that selected on a validation split), in order of first appearance."""
    found = [(str(r.summary.get("dataset", "?")), split, int(r.summary[f"{split}_samples"])) for r in runs
             for split in ("test", "val") if r.summary.get(f"{split}_samples") is not None]
    return tuple(dict.fromkeys(found))


def caption(rows: list[Row]) -> str | None:
    """What the numbers rest on, said under every table: the seeds, and each held-out split's size with what one
    sample is worth in points of accuracy (359 test images: one is 0.28 points) — a table of one seed on a small
    test set separates methods by little more than that."""
    if not rows:
        return None
    seeds = sorted({s for r in rows for s in r.seed_values}, key=_seed_order)
    counts = sorted({r.seeds for r in rows})
    if counts == [1]:
        each = "one run per row, so no spread is shown"
    elif len(counts) == 1:
        each = f"{counts[0]} runs per row: mean ± sample standard deviation"
    else:
        each = "the seeds column gives each row's count; mean ± sample standard deviation"
    said = [f"Seed{'s' if len(seeds) > 1 else ''} {_listed(seeds)} ({each})."]
    sizes = list(dict.fromkeys(h for r in rows for h in r.heldout))
    if sizes:
        parts = [f"{n:,} {'validation' if split == 'val' else 'test'} samples ({name}): one is "
                 f"{100 / n:.2g} points of accuracy" for name, split, n in sizes]
        said.append("Held out: " + "; ".join(parts) + ".")
    else:
        said.append("The runs did not record their held-out sizes (written by an older fedflat).")
    return " ".join(said)


def _seed_order(seed: Any) -> tuple[bool, Any]:
    """Integer seeds in numeric order (2 before 10), then any other by its text."""
    return (False, seed) if isinstance(seed, int) else (True, str(seed))


def _listed(values: list[Any]) -> str:
    """``0, 1, 2``; ``0-9`` for a long run of consecutive integers."""
    if len(values) > 4 and all(isinstance(v, int) for v in values) and values == list(range(values[0],
                                                                                             values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))


RADII = ("rho", "rho_max")  # the perturbation's radius, as its paper names it (FedSCAM adapts up to rho_max)


def radius_of(runs: list[Run]) -> str | None:
    """``rho=0.05`` (``rho_max=0.1``; values joined by ``/`` when the runs differ): the radius the runs' perturbation
    used, read from their config.yaml; None for a method without one (FedAvg), so a table says which radii it
    compares."""
    shown = []
    for key in RADII:
        values = sorted({r.config[f"algo.perturbation.{key}"] for r in runs
                         if r.config.get(f"algo.perturbation.{key}") is not None})
        if values:
            shown.append(f"{key}=" + "/".join(f"{v:g}" for v in values))
    return ", ".join(shown) or None


def _metric_names(runs: list[Run]) -> list[str]:
    """The ``eval.metrics`` the runs logged (``final_test_<name>``; not the per-class accuracies), in order."""
    names = [k[len("final_test_"):] for r in runs for k in r.summary if k.startswith("final_test_")]
    return [n for n in dict.fromkeys(names) if n not in ("acc", "loss") and not n.startswith("acc_class_")]


def build_rows(runs: list[Run], targets: list[float]) -> list[Row]:
    for t in targets:
        if not 0 < t <= 1:
            raise ReportError(f"--target-acc {t}: give accuracies as fractions in (0, 1], e.g. 0.75")
    return [summarize(g, targets) for g in group_runs(runs)]


# --- formatting ------------------------------------------------------------------------------------

def _pm(mean_sd: tuple[float | None, float | None], pm: str) -> str:
    mean, sd = mean_sd
    if mean is None:
        return DASH
    return f"{mean:.2f}" if sd is None else f"{mean:.2f}{pm}{sd:.2f}"


def _target_cells(row: Row, target: float) -> tuple[str, str]:
    rounds, seconds, reached = row.targets[target]
    if rounds is None:
        return DASH, DASH
    partial = f" ({reached}/{row.seeds})" if reached < row.seeds else ""
    shown = f"{rounds:.0f}" if rounds == int(rounds) else f"{rounds:.1f}"
    return f"{shown}{partial}", f"{seconds:.1f}"


def private(rows: list[Row]) -> bool:
    """Whether any row ran under differential privacy: its tables then have an epsilon column."""
    return any(r.epsilon is not None for r in rows)


def selecting(rows: list[Row]) -> bool:
    """Whether any row selected its model on a validation split: its tables then have a column of the selected
    model's test accuracy (``selected_test_acc``), the number a paper reports."""
    return any(r.selected[0] is not None for r in rows)


def with_radius(rows: list[Row]) -> bool:
    """Whether any row perturbed with a radius: its tables then have a *radius* column."""
    return any(r.radius is not None for r in rows)


def sized(rows: list[Row]) -> bool:
    """Whether the rows federate vectors of different sizes (adapters beside full models): their tables then have
    the columns *trainable params* and *up (KB/client/round)*. (Methods that upload a scalar or a vector more on
    one model differ in *comm (x FedAvg)* already.)"""
    return len({r.parameters for r in rows if r.parameters is not None}) > 1


def headers(targets: list[float], metrics: list[str] = (), epsilon: bool = False,
            selected: bool = False, radius: bool = False, sizes: bool = False) -> list[str]:
    cols = ["setting", "method", *(["radius"] if radius else []), "seeds", "final acc (%)", "best acc (%)",
            *(["test acc of selected (%)"] if selected else []), *(f"final {m} (%)" for m in metrics),
            *(["epsilon"] if epsilon else [])]
    for t in targets:
        cols += [f"rounds to {100 * t:g}%", f"time to {100 * t:g}% (s)"]
    return cols + ["s/round", "comm (x FedAvg)", *(["trainable params", "up (KB/client/round)"] if sizes else []),
                   "backprops/step", "status"]


def _cells(row: Row, targets: list[float], pm: str, metrics: list[str] = (), epsilon: bool = False,
           selected: bool = False, radius: bool = False, sizes: bool = False) -> list[str]:
    cells = [row.setting, row.method, *([row.radius or DASH] if radius else []), str(row.seeds), _pm(row.final, pm), _pm(row.best, pm),
             *([_pm(row.selected, pm)] if selected else []), *(_pm(row.metrics.get(m, (None, None)), pm) for m in metrics)]
    if epsilon:
        cells.append(DASH if row.epsilon is None else f"{row.epsilon:.3g}")
    for t in targets:
        cells += list(_target_cells(row, t))
    cells += [DASH if row.sec_per_round is None else f"{row.sec_per_round:.3f}",
              DASH if row.comm is None else f"{row.comm:g}"]
    if sizes:
        cells += [DASH if row.parameters is None else f"{row.parameters:,.0f}",
                  DASH if row.up_bytes is None else f"{row.up_bytes / 1000:.1f}"]
    cells += [DASH if row.backprops is None else f"{row.backprops:g}", row.status]
    return cells


def _row_metrics(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(m for r in rows for m in r.metrics))


def to_markdown(rows: list[Row], targets: list[float]) -> str:
    metrics, epsilon, selected, radius = _row_metrics(rows), private(rows), selecting(rows), with_radius(rows)
    sizes = sized(rows)
    head = headers(targets, metrics, epsilon, selected, radius, sizes)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in _cells(r, targets, " ± ", metrics, epsilon, selected, radius, sizes))
              + " |" for r in rows]
    note = caption(rows)
    return "\n".join(lines) + "\n" + (f"\n{note}\n" if note else "")


_LATEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "_": r"\_", "#": r"\#", "$": r"\$",
          "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", DASH: "--"}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in text)


def to_latex(rows: list[Row], targets: list[float]) -> str:
    metrics, epsilon, selected, radius = _row_metrics(rows), private(rows), selecting(rows), with_radius(rows)
    sizes = sized(rows)
    head = headers(targets, metrics, epsilon, selected, radius, sizes)
    spec = "ll" + "l" * radius + "r" * (len(head) - 3 - radius) + "l"
    out = [r"\begin{tabular}{" + spec + "}", r"\toprule",
           " & ".join(_latex_escape(h) for h in head) + r" \\", r"\midrule"]
    for r in rows:
        cells = []
        for c in _cells(r, targets, " PLUSMINUS ", metrics, epsilon, selected, radius, sizes):
            text = _latex_escape(c)
            cells.append("$" + text.replace(" PLUSMINUS ", r" \pm ") + "$" if "PLUSMINUS" in c else text)
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    note = caption(rows)
    if note:  # (under the tabular, as a table's note)
        out.append(r"\par\smallskip{\footnotesize " + _latex_escape(note).replace("±", r"$\pm$") + "}")
    return "\n".join(out) + "\n"


def to_csv(rows: list[Row], targets: list[float]) -> str:
    buf = io.StringIO()
    metrics = _row_metrics(rows)
    cols = ["setting", "method", *(["radius"] if with_radius(rows) else []), "seeds", "final_acc_mean", "final_acc_std", "best_acc_mean", "best_acc_std",
            *(["selected_test_acc_mean", "selected_test_acc_std"] if selecting(rows) else []),
            *(f"final_{m}_{stat}" for m in metrics for stat in ("mean", "std"))]
    cols += ["epsilon"] if private(rows) else []
    for t in targets:
        cols += [f"rounds_to_{t:g}", f"reached_{t:g}", f"seconds_to_{t:g}"]
    cols += ["sec_per_round", "comm_vs_fedavg", *(["trainable_parameters", "up_bytes_per_client_round"]
                                                  if sized(rows) else []),
             "backprops_per_step", "rounds", "status", "seed_values", "heldout_samples"]
    writer = csv.writer(buf)
    writer.writerow(cols)
    num = lambda v: "" if v is None else f"{v:.6g}"  # noqa: E731
    for r in rows:
        line = [r.setting, r.method, *([r.radius or ""] if with_radius(rows) else []), r.seeds, num(r.final[0]), num(r.final[1]), num(r.best[0]), num(r.best[1]),
                *([num(r.selected[0]), num(r.selected[1])] if selecting(rows) else []), *(num(v) for m in metrics for v in r.metrics.get(m, (None, None)))]
        line += [num(r.epsilon)] if private(rows) else []
        for t in targets:
            rounds, seconds, reached = r.targets[t]
            line += [num(rounds), reached, num(seconds)]
        line += [num(r.sec_per_round), num(r.comm), *([num(r.parameters), num(r.up_bytes)] if sized(rows) else []),
                 num(r.backprops), num(r.rounds), r.status,
                 " ".join(map(str, r.seed_values)), " ".join(f"{name}:{split}:{n}" for name, split, n in r.heldout)]
        writer.writerow(line)
    return buf.getvalue()


FORMATS = {"markdown": to_markdown, "csv": to_csv, "latex": to_latex}


def report(paths: Iterable[str | Path], targets: list[float] = (), fmt: str = "markdown",
           round: int | None = None) -> str:
    """The table of every run under ``paths`` in ``fmt`` (markdown, csv or latex); with ``round``, of the
    runs as they stood after that round (:func:`runs_at`)."""
    runs = find_runs(paths)
    return table(runs if round is None else runs_at(runs, round), targets, fmt)


def table(runs: list[Run], targets: Iterable[float], fmt: str) -> str:
    """The table of ``runs`` in ``fmt`` (markdown, csv or latex)."""
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    targets = sorted(set(targets))
    return FORMATS[fmt](build_rows(runs, targets), targets)
