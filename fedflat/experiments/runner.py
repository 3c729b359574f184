"""The run loop: rounds, evaluation, checkpoints and the run folder, kept consistent whatever happens.

:func:`run_experiment` is what ``fedflat.run`` (:mod:`fedflat.api`), a sweep's cells and a resume call; the
:class:`Runner` drives the rounds of a :class:`Simulation` and writes the run folder (config.yaml, metrics.jsonl,
summary.json, checkpoint.pt, model.pt), so that an interruption at any moment leaves a folder that resumes. The
run's summary (summary.json: its account, end status, test selection, warnings) is kept by a
:class:`~fedflat.experiments.summary.RunSummary`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fedflat.algorithms.attacks import backdoor_of
from fedflat.config import Config, as_config, dump_yaml, resolve
from fedflat.core import BudgetSpent, ConfigError, Diverged
from fedflat.core.registry import display_label
from fedflat.data import Dataset
from fedflat.engine.checkpoint import make_payload, read_checkpoint, remove_temporaries, save_checkpoint
from fedflat.engine.cores import torch_threads
from fedflat.engine.inputs import UserInputs
from fedflat.engine.simulation import RoundResult, Simulation, uninterrupted
from fedflat.experiments.callbacks import CallbackError, Callbacks, RunInfo, build_callbacks
from fedflat.experiments.rundir import (DiskFull, RunDir, check_output_folder, hold, interruption, is_disk_full,
                                        remove_if_empty)
from fedflat.experiments.summary import RunSummary, cpu_state
from fedflat.files import atomic_write_bytes, json_safe
from fedflat.progress import progress_bar


@dataclass
class History:
    """What a run produced: per-evaluation metrics, the summary, the final global model (flat).

    ``metrics`` holds the lines of ``metrics.jsonl``: one dict per evaluated round, and one per round between
    whose parts logged values (``ctx.log``; its training numbers, without the evaluation's keys), ``summary`` what
    ``summary.json`` holds, ``config`` the resolved config, ``final_parameters`` the global model as one flat
    vector and ``state_dict`` as the model's state dict (both on the CPU, whatever the run's device); ``run_dir`` is
    the run folder (None with ``save=False``).
    """

    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]
    final_parameters: torch.Tensor
    run_dir: Path | None = None
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)

    def column(self, key: str) -> list[Any]:
        """The metric ``key`` over the metrics lines (``history.column("test_acc")``; None where a line lacks it, as
        the line of a round not evaluated lacks the evaluation's keys)."""
        return [m.get(key) for m in self.metrics]

    @property
    def final_test_acc(self) -> float | None:
        """The test accuracy of the final model (a run selecting on a validation split scores it on the test split at
        its end; None where nothing was scored: a run that did not finish)."""
        return self.summary.get("final_test_acc")


def _label(cfg: Config, dataset: Dataset | None = None) -> str:
    parts = [cfg.name] if cfg.name else []
    parts += [cfg.algo["name"], dataset.name if dataset is not None else cfg.data.name, f"s{cfg.seed}"]
    return "-".join(p.replace("/", "_").replace(" ", "_") for p in parts)


@dataclass
class Output:
    """Where a run's results go and what it tells the user on the way."""

    save: bool = True
    out: str | Path | None = None
    run_dir: str | Path | None = None
    resume: str | Path | None = None
    progress: bool = True  # progress bar
    announce: bool = True  # print the run folder when it is made (stderr)
    group: str | None = None  # the sweep or tune study the run is a cell of (trackers group by it)
    job: str | None = None  # its part of a tune study: trials, final


def run_experiment(config: Config | dict | str | Path | None = None, *, overrides: list[str] | tuple[str, ...] = (),
        dataset: Dataset | None = None, model_fn: Callable[[], nn.Module] | None = None,
        clients: Sequence[Sequence[int]] | None = None,
        out: str | Path | None = None, save: bool = True, progress: bool = True,
        run_dir: str | Path | None = None, resume: str | Path | None = None,
        announce: bool | None = None,
        driver: Callable[[Simulation], Callable[[int], RoundResult]] | None = None,
        callbacks: Sequence[Any] = (), group: str | None = None, job: str | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> History:
    """Runs one federated experiment and returns its :class:`History`.

    ``config`` is a :class:`Config`, a dict, a YAML path, or None for the embedded quickstart;
    ``overrides`` are ``key=value`` strings. ``dataset`` (a :class:`fedflat.data.Dataset`) and
    ``model_fn`` (a zero-argument ``nn.Module`` factory) replace the configured ones; ``clients`` (one
    sequence of training-sample indices per client: a natural split) replaces ``data.partition`` and sets
    ``data.num_clients``. With ``save``,
    results go to a new folder under ``out`` (default ``config.out``), or to exactly ``run_dir``
    (created; it must not exist). ``resume`` continues the run folder it names from its latest
    checkpoint (:func:`fedflat.experiments.resume.resume` also reads its config). ``announce``
    (default: ``progress``) prints the run folder to stderr as soon as it exists. ``driver(sim)`` returns
    the function that trains round ``t`` (default: ``sim.run_round``, on the config's executor);
    :mod:`fedflat.flower` passes one that trains each round on the nodes of a Flower federation.
    ``callbacks``: objects told of the run's start, each round, evaluation and checkpoint, and its end
    (:class:`Callback`, :mod:`fedflat.experiments.callbacks`), after the loggers of the config's ``loggers``
    (tensorboard, csv, wandb, mlflow: docs/experiments.md, "Tracking runs"). ``group`` and ``job`` name the sweep or
    tune study (and its part) a run is a cell of, for the trackers. ``loss_fn(logits, y)``, returning one loss per
    sample (``reduction="none"``), replaces ``train.loss`` in every engine, executor and diagnostic
    (docs/experiments.md, "Loss and metrics"). ``fedflat.run`` is this function.
    """
    cfg = as_config(config, overrides)
    inputs = UserInputs(dataset, model_fn, clients, loss_fn)
    if cfg.secure_aggregation is not None and driver is None:
        raise ConfigError("secure_aggregation carries the uploads of a Flower run: run this config with `fedflat "
                          "flower-sim` or deploy it with `fedflat flower-app` (docs/flower.md)")
    if clients is not None and cfg.data.num_clients != len(clients):
        cfg = as_config(cfg, [f"data.num_clients={len(clients)}"])
    where = Output(save, out, run_dir, resume, progress, progress if announce is None else announce, group, job)
    with torch_threads(None), ExitStack() as stack:  # the caller's torch thread count comes back afterwards
        if resume is not None:
            stack.enter_context(hold(resume))  # refuse a second writer before anything is loaded
        elif save:
            made = check_output_folder(run_dir if run_dir is not None else (out if out is not None else cfg.out))
            stack.callback(remove_if_empty, made)  # (what holds the run's folder, or another run's, stays)
        from fedflat.experiments.loggers import build_loggers

        # a logger's library and a callback's options are checked before a folder is made
        watchers = [*build_loggers(cfg.loggers, group), *build_callbacks(cfg.callbacks), *callbacks]
        sim = Simulation(cfg, inputs)
        stack.callback(sim.close)
        resolved = inputs.recorded(resolve(cfg))  # (a user's dataset, model, split or loss by name)
        folder, checkpoint = _open_folder(cfg, where, stack, dataset)
        try:
            runner = Runner(cfg, sim, resolved, folder, checkpoint, watchers, where)
            if driver is not None:
                try:
                    runner.train_round = driver(sim)
                except BaseException as err:
                    runner.callbacks.end({**runner.summary, "status": "failed", "reason": f"{type(err).__name__}: "
                                                                                          f"{err}"})
                    raise
                runner.summary["driver"] = driver.__module__  # its clients' state is not in this folder
        except (OSError, CallbackError) as err:
            new_folder = folder is not None and resume is None  # nothing of this run is worth keeping
            if isinstance(err, CallbackError):
                if new_folder:
                    shutil.rmtree(folder.path, ignore_errors=True)
                raise
            if is_disk_full(err) and new_folder:
                shutil.rmtree(folder.path, ignore_errors=True)
                raise DiskFull(f"no space left on the device of {folder.path.parent}: free some space and run "
                               "again") from None
            raise
        return runner.run(progress)


def _open_folder(cfg: Config, where: Output, stack: ExitStack,
                 dataset: Dataset | None) -> tuple[RunDir | None, dict[str, Any] | None]:
    """The run folder (made, or readied to resume, and held by this process) and the checkpoint to continue."""
    checkpoint = None
    if where.resume is not None:
        folder = RunDir(Path(where.resume))
        checkpoint = prepare_resume(folder.path)
    elif not where.save:
        return None, None
    else:
        folder = RunDir.at(where.run_dir) if where.run_dir is not None else RunDir.create(
            where.out if where.out is not None else cfg.out, _label(cfg, dataset))
        stack.enter_context(hold(folder.path))
    if where.announce:
        print(f"run folder: {folder.path}", file=sys.stderr, flush=True)
    return folder, checkpoint


def prepare_resume(run_dir: str | Path) -> dict[str, Any] | None:
    """Readies a run folder to continue: removes torn temporaries, reads the checkpoint, and rewrites
    ``metrics.jsonl`` to exactly the checkpoint's lines (dropping those of rounds that will run again).
    Returns the checkpoint, or None when the run must start from round 0."""
    run_dir = Path(run_dir)
    remove_temporaries(run_dir)
    payload = read_checkpoint(run_dir)
    metrics = payload["metrics"] if payload is not None else []
    rundir = RunDir(run_dir)
    if rundir.metrics_path.exists() or metrics:
        text = "".join(json.dumps(json_safe(m)) + "\n" for m in metrics)
        atomic_write_bytes(rundir.metrics_path, text.encode())
    return payload


class Runner:
    """Drives the rounds and keeps the run folder consistent whatever happens; its summary is kept by a
    :class:`~fedflat.experiments.summary.RunSummary`."""

    def __init__(self, cfg: Config, sim: Simulation, resolved: dict[str, Any], run_dir: RunDir | None,
                 checkpoint: dict[str, Any] | None = None, callbacks: Sequence[Any] = (),
                 where: Output | None = None):
        self.cfg, self.sim, self.resolved, self.run_dir = cfg, sim, resolved, run_dir
        where = where or Output()
        self.metrics: list[dict[str, Any]] = []
        self.start_round = 0
        # A round trained and committed whose metrics line is not yet written (interrupted in evaluation):
        # the checkpoint carries it and a resume writes it first.
        self._owed: RoundResult | None = None
        # Called after every round as hook(runner, round_index, record_or_None); record is the metrics
        # line of an evaluated round, which a hook may extend before it is written.
        self.hooks: list[Callable[["Runner", int, dict[str, Any] | None], None]] = []
        self.train_round: Callable[[int], RoundResult] = sim.run_round  # a federation's driver replaces it
        self._training: int | None = None  # the round being trained, until it is committed
        self.run_summary = RunSummary(cfg, sim, resolved, run_dir, where.job)
        if checkpoint is not None:
            self._restore(checkpoint)
        info = RunInfo(config=copy.deepcopy(resolved), run_dir=run_dir.path if run_dir else None,
                       name=run_dir.path.name if run_dir else _label(cfg), start_round=self.start_round,
                       metrics=copy.deepcopy(self.metrics), group=where.group, job=where.job,
                       state_fn=sim.server.model_state)
        self.callbacks = Callbacks(callbacks, info)
        if checkpoint is not None:
            self.callbacks.load_state_dict(checkpoint.get("callbacks") or {})
        self.callbacks.start(self.summary)  # before anything is written: a logger that cannot start costs nothing
        if run_dir is not None:
            run_dir.reserve()
            run_dir.write_config(dump_yaml(resolved))
            run_dir.write_summary(self.summary)
        if cfg.diagnostics.every:
            from fedflat.metrics.recorder import DiagnosticsRecorder

            self.hooks.insert(0, DiagnosticsRecorder(cfg.diagnostics))  # its scalars join the line callbacks see
        if backdoor_of(sim.algorithm.path.stages) is not None:  # under attack=backdoor: its success beside the accuracy
            self.hooks.append(_backdoor_metric)

    @property
    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` holds (:attr:`RunSummary.summary`)."""
        return self.run_summary.summary

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        """Continues from a checkpoint: state, metrics so far, summary counters (wall time adds up)."""
        self.sim.server.load_state_dict(checkpoint["state"])
        self.sim.server.backprops = checkpoint.get("backprops", 0)
        self.start_round = checkpoint["round"]
        self.metrics = [dict(m) for m in checkpoint["metrics"]]
        self.run_summary.restore(checkpoint["summary"], self.start_round)
        if checkpoint.get("owed") is not None:
            self._owed = RoundResult(**checkpoint["owed"])

    def _checkpoint(self) -> None:
        if self.run_dir is None:
            return
        owed = dataclasses.asdict(self._owed) if self._owed is not None else None
        self.summary.update(self.callbacks.run.notes)
        payload = make_payload(self.sim, self.summary["rounds"], self.metrics, self.summary, owed)
        path = save_checkpoint(self.run_dir.path, {**payload, "callbacks": self.callbacks.state_dict()})
        self.run_summary.checkpointed = self.summary["rounds"]
        self.callbacks.emit("on_checkpoint", self.summary["rounds"], path)

    def run(self, progress: bool) -> History:
        start, wall_before = time.perf_counter(), self.summary["wall_seconds"]
        bar = progress_bar(range(self.start_round, self.cfg.rounds), enabled=progress,
                           desc=display_label(self.summary["algorithm"]), unit="round", dynamic_ncols=True,
                           leave=True, initial=self.start_round, total=self.cfg.rounds)
        every = self.cfg.checkpoint_every
        try:
            if self._owed is not None:
                self._record(self._owed.round, self._owed, bar)
            for t in bar:
                if self.callbacks.run.should_stop:
                    break
                self._round(t, bar)
                if every and (t + 1) % every == 0 and t + 1 != self.cfg.rounds:
                    self.summary["wall_seconds"] = wall_before + time.perf_counter() - start
                    self._checkpoint()
                    self.run_summary.write()
            self.run_summary.conclude(self.callbacks.run)
        except Diverged as err:
            self.summary.update(status="diverged", reason=str(err))
            self._diverged_line()
        except BudgetSpent as err:
            self.summary.update(status="budget spent", reason=str(err))
        except KeyboardInterrupt as err:
            self.summary.update(status="failed", reason=f"interrupted ({interruption(err)})")
            err.run_dir = self.run_dir.path if self.run_dir else None  # for the message that says how to resume
            raise
        except Exception as err:
            if is_disk_full(err):
                raise self.run_summary.disk_full(err) from None
            self.summary.update(status="failed", reason=f"{type(err).__name__}: {err}")
            raise
        finally:
            bar.close()
            try:
                self._finish(wall_before + time.perf_counter() - start)
            finally:
                self.callbacks.end(self.summary)  # after the results are on disk
        return self.history()

    def _finish(self, wall_seconds: float) -> None:
        """The final checkpoint (of the last complete round), model and summary; on a full disk the reserve
        is given back so that at least the summary says what happened."""
        self.run_summary.close(wall_seconds, self.callbacks)
        try:
            self.run_summary.test_selection(self.callbacks)
            if self.summary["status"] != "diverged":
                self._checkpoint()  # the final state, or the last complete round of an interrupted run
            self.run_summary.save(self.callbacks)
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise self.run_summary.disk_full(err) from None
        if self.run_dir is not None:
            self.run_dir.release_reserve()

    def _diverged_line(self) -> None:
        """The metrics line of a round whose training diverged (nothing of it was committed), its losses null, as
        the line of one whose evaluation diverged holds them (docs/experiments.md, "A run that diverged")."""
        if self._training is None:
            return  # it diverged in its evaluation: the line is written
        split = self.sim.heldout
        with uninterrupted():
            self._append({"round": self._training + 1, f"{split}_acc": None, f"{split}_loss": None,
                          "train_loss": None, "lr": self.sim.server.lr_at(self._training), "diverged": True})

    def _round(self, t: int, bar) -> None:
        self._training = t  # (a round that raises Diverged here writes its line with its losses null)
        result = self._train(t)
        self._training = None
        if self._evaluated(t):
            record = self._record(t, result, bar)
        else:
            for hook in self.hooks:
                hook(self, t, None)
            record = _logged_line(result)
            if result.logged:  # its line is in metrics.jsonl (:meth:`_settle`)
                self.callbacks.emit("on_log", t + 1, record)
        self.callbacks.emit("on_round_end", t + 1, record)

    def _evaluated(self, t: int) -> bool:
        """Round ``t`` gets a metrics line: every ``eval.every`` rounds, the last round, and every round that
        records diagnostics (so their headlines land in metrics.jsonl whatever the two periods are)."""
        n, diagnostics = t + 1, self.cfg.diagnostics.every
        return n % self.cfg.eval.every == 0 or n == self.cfg.rounds or bool(diagnostics and n % diagnostics == 0)

    def _train(self, t: int) -> RoundResult:
        """Round ``t``, and its account in the summary. The simulation commits a round as one transaction;
        the account is taken with signals held, and taken here too when an interrupt hit between the two,
        so the summary always names the round the state is at."""
        try:
            result = self.train_round(t)
            with uninterrupted():
                self._settle(result)
        except KeyboardInterrupt:
            last = self.sim.server.last_round
            if last is not None and last.round == t and self.summary["rounds"] == t:
                with uninterrupted():
                    self._settle(last)
            raise
        finally:
            self.run_summary.note_deaths(t)
        return result

    def _settle(self, result: RoundResult) -> None:
        """A committed round's account, and the metrics line of a round not evaluated whose parts logged values
        (``ctx.log``): taken together, so a checkpoint never holds the round without its line."""
        self.run_summary.account(result)
        self._owed = result if self._evaluated(result.round) else None
        if result.logged and not self._evaluated(result.round):
            self._append(_logged_line(result))

    def _append(self, record: dict[str, Any]) -> None:
        """``record`` appended to ``metrics.jsonl`` and to the lines a checkpoint carries."""
        if self.run_dir is not None:
            self.run_dir.append_metrics(record)
        self.metrics.append(record)

    def _record(self, t: int, result: RoundResult, bar) -> dict[str, Any]:
        """Evaluates round ``t`` and writes its metrics line (the line is written with signals held)."""
        sim, s = self.sim, self.summary
        eval_start = time.perf_counter()
        acc, loss = sim.evaluate()
        eval_seconds = time.perf_counter() - eval_start
        split = sim.heldout  # "test", or "val" for a run that selects on a validation split
        fields = _training_fields(result)
        extra = {f"{split}_{k}": v for k, v in sim.eval_metrics.items()}  # eval.metrics (F1, AUROC, ...)
        record = {"round": t + 1, f"{split}_acc": acc, f"{split}_loss": loss, **extra, "train_loss": fields["train_loss"],
                  "lr": fields["lr"], "seconds": fields["seconds"], "eval_seconds": eval_seconds,
                  "train_seconds": s["train_seconds"], **fields}
        for hook in self.hooks:
            hook(self, t, record)
        with uninterrupted():
            self._append(record)
            self.run_summary.evaluated(t, acc, loss, extra, eval_seconds)
            self._owed = None
        bar.set_postfix(acc=f"{acc:.3f}", loss=f"{result.train_loss:.3f}", refresh=False)  # shown with its count
        self.callbacks.emit("on_evaluation", t + 1, record)
        if not math.isfinite(loss):  # a finite model whose evaluation overflows (e.g. a poisoned aggregate)
            raise Diverged(f"round {t + 1}: the {split} loss is {loss} (try a smaller train.lr, or train.clip)")
        return record

    def history(self) -> History:
        return History(metrics=self.metrics, summary=self.summary, config=self.resolved,
                       final_parameters=self.sim.server.w.detach().cpu().clone(),
                       run_dir=self.run_dir.path if self.run_dir else None,
                       state_dict=cpu_state(self.sim.server.model_state()))


def _backdoor_metric(runner: Runner, t: int, record: dict[str, Any] | None) -> None:
    """``backdoor_acc`` in an evaluated round's line (:meth:`Simulation.backdoor_accuracy`)."""
    if record is not None:
        record["backdoor_acc"] = runner.sim.backdoor_accuracy()


def _logged_line(result: RoundResult) -> dict[str, Any]:
    """The line of a round not evaluated: its training numbers with the values its parts logged (``ctx.log``)."""
    return {"round": result.round + 1, **_training_fields(result)}


def _training_fields(result: RoundResult) -> dict[str, Any]:
    """A round's training numbers as its metrics line holds them (evaluated or not)."""
    return {"train_loss": result.train_loss, "lr": result.lr, "seconds": result.seconds,
            "up_vectors": result.up_vectors, "down_vectors": result.down_vectors, "up_bytes": result.up_bytes,
            "down_bytes": result.down_bytes, "clients": result.clients, "dropped": len(result.dropped),
            "drift": result.drift, "backprops_per_step": result.backprops_per_step, "store": result.store,
            **result.log}
