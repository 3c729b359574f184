"""The run loop: rounds, evaluation, checkpoints and the run folder, kept consistent whatever happens.

:func:`run_experiment` is what ``fedflat.run`` (:mod:`fedflat.api`), a sweep's cells and a resume call; the
:class:`Runner` drives the rounds of a :class:`Simulation` and writes the run folder (config.yaml, metrics.jsonl,
summary.json, checkpoint.pt, model.pt), so that an interruption at any moment leaves a folder that resumes.
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
from fedflat.data import Dataset
from fedflat.engine.checkpoint import make_payload, read_checkpoint, remove_temporaries, save_checkpoint
from fedflat.engine.inputs import UserInputs
from fedflat.engine.simulation import RoundResult, Simulation, uninterrupted
from fedflat.engine.threads import torch_threads
from fedflat.experiments.callbacks import CallbackError, Callbacks, ModelCheckpoint, RunInfo, build_callbacks
from fedflat.experiments.personal import save_personal_parts
from fedflat.experiments.rundir import (DiskFull, RunDir, check_output_folder, hold, interruption, is_disk_full,
                                       machine_info, versions)
from fedflat.files import atomic_write_bytes, json_safe
from fedflat.progress import progress_bar


def dropped_note(dropped: dict[str, list[int]]) -> str:
    """What a completed run that left sampled clients out says in its status line and summary's ``reason``."""
    rounds = sorted(dropped, key=int)
    shown = ", ".join(rounds[:10]) + (", ..." if len(rounds) > 10 else "")
    return (f"{sum(map(len, dropped.values()))} sampled clients left out of {len(rounds)} rounds ({shown}): their "
            "nodes failed or did not answer in time; summary.json's dropped_clients names them")


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
        """One metric over the metrics lines (``history.column("test_acc")``; None where a line lacks it, as the line
        of a round not evaluated lacks the evaluation's keys)."""
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
    checkpoint (:func:`fedflat.experiments.checkpoint.resume` also reads its config). ``announce``
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
            check_output_folder(run_dir if run_dir is not None else (out if out is not None else cfg.out))
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
    """Drives the rounds and keeps the run folder consistent whatever happens."""

    def __init__(self, cfg: Config, sim: Simulation, resolved: dict[str, Any], run_dir: RunDir | None,
                 checkpoint: dict[str, Any] | None = None, callbacks: Sequence[Any] = (),
                 where: Output | None = None):
        self.cfg, self.sim, self.resolved, self.run_dir = cfg, sim, resolved, run_dir
        self.metrics: list[dict[str, Any]] = []
        self.start_round = 0
        # A round trained and committed whose metrics line is not yet written (interrupted in evaluation):
        # the checkpoint carries it and a resume writes it first.
        self._owed: RoundResult | None = None
        # Called after every round as hook(runner, round_index, record_or_None); record is the metrics
        # line of an evaluated round, which a hook may extend before it is written.
        self.hooks: list[Callable[["Runner", int, dict[str, Any] | None], None]] = []
        self.train_round: Callable[[int], RoundResult] = sim.run_round  # a federation's driver replaces it
        self.checkpointed = 0  # the round of the checkpoint on disk (a resume starts from it)
        self._training: int | None = None  # the round being trained, until it is committed
        alg = sim.algorithm
        self.summary: dict[str, Any] = {
            "status": "running", "reason": None, "rounds": 0, "rounds_planned": cfg.rounds,
            "algorithm": alg.label, "dataset": resolved["data"]["name"],
            "data_source": sim.dataset.source or None, "data_files": list(sim.dataset.files),  # what it read
            "model": resolved["model"]["name"],
            "seed": cfg.seed, "parameters": sim.num_parameters,
            "buffers": sim.model.buffer_layout.size, "engine": sim.report.engine,
            "engine_reason": sim.report.engine_reason,
            "device": str(sim.device),
            "gradient": sim.oracle.gradient,  # native, python (hand-derived) or autograd: docs/benchmarks.md
            "threads": sim.thread_counts(),  # the bits depend on them: a resume that changes them says so
            "up_vectors": None, "down_vectors": None, "up_bytes": 0, "down_bytes": 0,
            "backprops_per_step": alg.backprops_per_step, "client_state_vectors": alg.client_state_vectors,
            "evaluated_on": sim.heldout, "evaluation": "personalized" if sim.personalized else "global",
            "final_test_acc": None, "best_test_acc": None, "best_round": None,
            "final_test_loss": None,
            **({"final_val_acc": None, "best_val_acc": None, "final_val_loss": None} if sim.heldout == "val" else {}),
            "wall_seconds": 0.0, "train_seconds": 0.0, "eval_seconds": 0.0,
            "versions": versions(), "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if sim.server.privacy is not None:
            self.summary.update(privacy=sim.server.privacy.describe(), epsilon=0.0)
        if checkpoint is not None:
            self._restore(checkpoint)
        where = where or Output()
        self.job = where.job
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
        if backdoor_of(sim.algorithm.stages) is not None:  # under attack=backdoor: its success beside the accuracy
            self.hooks.append(_backdoor_metric)

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        """Continues from a checkpoint: state, metrics so far, summary counters (wall time adds up)."""
        self.sim.server.load_state_dict(checkpoint["state"])
        self.sim.server.backprops = checkpoint.get("backprops", 0)
        self.start_round = self.checkpointed = checkpoint["round"]
        self.metrics = [dict(m) for m in checkpoint["metrics"]]
        saved = checkpoint["summary"]
        self.summary.update({k: v for k, v in saved.items() if k not in ("versions", "machine", "threads", "warnings")})
        self.summary.update(status="running", reason=None, rounds_planned=self.cfg.rounds)  # rounds= may extend
        self._note_thread_change(saved.get("threads"))
        self.summary["resumed"] = [*saved.get("resumed", []), {"round": self.start_round,
                                                                 "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}]
        if checkpoint.get("owed") is not None:
            self._owed = RoundResult(**checkpoint["owed"])

    def _note_thread_change(self, before: dict[str, Any] | None) -> None:
        """A resume on other torch thread counts than the run so far (``threads=``, ``executor.*``, or ``auto`` with
        another core share) continues it correctly, but a reduction split over other threads rounds differently:
        the numbers from here on may differ in the last bits from an uninterrupted run's. Said, and recorded."""
        now = self.summary["threads"]
        if before is None or before == now:  # (a checkpoint of an older fedflat does not say)
            return
        self.summary["threads_changed"] = [*self.summary.get("threads_changed", []),
                                           {"round": self.start_round + 1, "from": before, "to": now}]
        text = lambda counts: ", ".join(f"{k} {v}" for k, v in counts.items())  # noqa: E731
        print(f"fedflat: warning: the run trained on torch threads ({text(before)}), this resume on ({text(now)}): "
              f"from round "
              f"{self.start_round + 1} on its numbers may differ in the last bits from an uninterrupted run's "
              "(recorded in summary.json as threads_changed)", file=sys.stderr)

    def _checkpoint(self) -> None:
        if self.run_dir is None:
            return
        owed = dataclasses.asdict(self._owed) if self._owed is not None else None
        self.summary.update(self.callbacks.run.notes)
        payload = make_payload(self.sim, self.summary["rounds"], self.metrics, self.summary, owed)
        path = save_checkpoint(self.run_dir.path, {**payload, "callbacks": self.callbacks.state_dict()})
        self.checkpointed = self.summary["rounds"]
        self.callbacks.emit("on_checkpoint", self.summary["rounds"], path)

    def run(self, progress: bool) -> History:
        start, wall_before = time.perf_counter(), self.summary["wall_seconds"]
        bar = progress_bar(range(self.start_round, self.cfg.rounds), enabled=progress, desc=self.summary["algorithm"],
                           unit="round", dynamic_ncols=True, leave=True, initial=self.start_round,
                           total=self.cfg.rounds)
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
                    self._save_summary()
            self._end_status()
            self._warn_at_chance()
            if self.summary["status"] == "completed" and self.summary.get("dropped_clients"):
                self.summary["reason"] = dropped_note(self.summary["dropped_clients"])
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
                raise self._disk_full(err) from None
            self.summary.update(status="failed", reason=f"{type(err).__name__}: {err}")
            raise
        finally:
            bar.close()
            try:
                self._finish(wall_before + time.perf_counter() - start)
            finally:
                self.callbacks.end(self.summary)  # after the results are on disk
        return self.history()

    def _end_status(self) -> None:
        """Completed, or stopped when a callback asked to (``should_stop``) before the last round."""
        run = self.callbacks.run
        if run.should_stop and self.summary["rounds"] < self.cfg.rounds:
            self.summary.update(status="stopped", reason=run.stop_reason or "a callback set should_stop")
        else:
            self.summary["status"] = "completed"

    def _finish(self, wall_seconds: float) -> None:
        """The final checkpoint (of the last complete round), model and summary; on a full disk the reserve
        is given back so that at least the summary says what happened."""
        self.summary["wall_seconds"] = wall_seconds
        self.summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        if self.callbacks.errors:
            self.summary["callback_errors"] = [*self.summary.get("callback_errors", []), *self.callbacks.errors]
            self.callbacks.errors = []
        try:
            self._test_selection()
            if self.summary["status"] != "diverged":
                self._checkpoint()  # the final state, or the last complete round of an interrupted run
            self._save()
        except OSError as err:
            if not is_disk_full(err):
                raise
            raise self._disk_full(err) from None
        if self.run_dir is not None:
            self.run_dir.release_reserve()

    def _test_selection(self) -> None:
        """A run that selected on a validation split (``data.validation``) ends with the number a paper reports:
        the test accuracy of the model it selected. ``final_test_acc``/``final_test_loss`` are the final model's
        (as the run evaluated it: personalized where it is); ``selected_test_acc``/``selected_test_loss`` the
        selected model's: the one a ``model_checkpoint`` callback kept (``best_model.pt``, chosen on its validation
        metric), else the final one (``model.pt``), as ``selected_file`` and ``selected_round`` say. Only the end
        of a finished run looks at the test split, and never a tuning trial's (``fedflat tune`` selects first)."""
        sim, s = self.sim, self.summary
        if (sim.problem.test_split is None or self.job == "trials"
                or s["status"] not in ("completed", "stopped", "budget spent") or not s["rounds"] or (sim.personalized and sim.personal_evaluation is not None)):
            return
        kept = next((cb for cb in self.callbacks.active if isinstance(cb, ModelCheckpoint)
                     and cb.best_state is not None), None)
        with sim.on_test_split():
            acc, loss = sim.evaluate()
            s.update(final_test_acc=acc, final_test_loss=loss)
            if kept is None:
                s.update(selected_test_acc=acc, selected_test_loss=loss, selected_file="model.pt",
                         selected_round=s["rounds"])
            elif not sim.personalized:  # (a personalized run keeps its clients' parts of the final round only)
                w, buffers = sim.model.vectors(kept.best_state)
                acc, loss = sim.evaluate_model(w, buffers)
                s.update(selected_test_acc=acc, selected_test_loss=loss, selected_file=kept.filename,
                         selected_round=kept.best_round)

    def _disk_full(self, err: OSError) -> DiskFull:
        """Records the failure in summary.json (in the space the reserve gives back) and says what to do."""
        where = self.run_dir.path if self.run_dir else "the output folder"
        message = (f"disk full while writing {getattr(err, 'filename', None) or where}: free some space, then "
                   f"`fedflat resume {where}` continues from the last checkpoint")
        self.summary.update(status="failed", reason=message)
        if self.run_dir is not None:
            self.run_dir.release_reserve()
            try:  # the rounds a resume starts from, not those trained since (their checkpoint did not fit)
                self.run_dir.write_summary({**self.summary, "rounds": self.checkpointed})
            except OSError:
                pass  # still no room: the summary keeps its last state; the message says what happened
        return DiskFull(message)

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
            self._note_deaths(t)
        return result

    def _note_deaths(self, t: int) -> None:
        """Ray workers that died in round ``t`` (their clients were trained again): summary.json's
        ``worker_deaths`` and a warning on stderr."""
        take = getattr(getattr(self.sim, "executor", None), "take_deaths", None)
        for death in take() if take is not None else []:
            self.summary.setdefault("worker_deaths", []).append({"round": t + 1, **death})
            again = (f"its {death['clients']} clients trained again on worker {death['redone_on']}"
                     if "redone_on" in death else "no worker was left")
            print(f"fedflat: warning: Ray worker {death['worker']} died in round {t + 1} ({death['error']}); "
                  f"{again} (recorded in summary.json)", file=sys.stderr, flush=True)

    def _settle(self, result: RoundResult) -> None:
        """A committed round's account, and the metrics line of a round not evaluated whose parts logged values
        (``ctx.log``): taken together, so a checkpoint never holds the round without its line."""
        self._account(result)
        if result.logged and not self._evaluated(result.round):
            self._append(_logged_line(result))

    def _append(self, record: dict[str, Any]) -> None:
        """``record`` appended to ``metrics.jsonl`` and to the lines a checkpoint carries."""
        if self.run_dir is not None:
            self.run_dir.append_metrics(record)
        self.metrics.append(record)

    def _account(self, result: RoundResult) -> None:
        s, t = self.summary, result.round
        s["rounds"] = t + 1
        s["train_seconds"] += result.seconds
        # communication as measured from the payloads: vectors per sampled client, bytes in total
        s["up_vectors"], s["down_vectors"] = result.up_vectors, result.down_vectors
        s["up_bytes"] += result.up_bytes * result.clients
        s["down_bytes"] += result.down_bytes * result.clients
        if result.dropped:
            s.setdefault("dropped_clients", {})[str(t + 1)] = result.dropped
        if result.rejected:
            s.setdefault("rejected_clients", {})[str(t + 1)] = result.rejected
        if "epsilon" in result.log:
            s["epsilon"] = result.log["epsilon"]
        self._owed = result if self._evaluated(t) else None

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
            s["eval_seconds"] += eval_seconds
            if s[f"best_{split}_acc"] is None or acc > s[f"best_{split}_acc"]:
                s[f"best_{split}_acc"], s["best_round"] = acc, t + 1
            s[f"final_{split}_acc"], s[f"final_{split}_loss"] = acc, loss
            s.update({f"final_{k}": v for k, v in extra.items()})
            self._owed = None
        bar.set_postfix(acc=f"{acc:.3f}", loss=f"{result.train_loss:.3f}", refresh=False)  # shown with its count
        self.callbacks.emit("on_evaluation", t + 1, record)
        if not math.isfinite(loss):  # a finite model whose evaluation overflows (e.g. a poisoned aggregate)
            raise Diverged(f"round {t + 1}: the {split} loss is {loss} (try a smaller train.lr, or train.clip)")
        return record

    def _warn_at_chance(self) -> None:
        """A run that completed at chance accuracy (:func:`at_chance`) says so: summary.json's ``warnings`` and
        stderr."""
        split = self.sim.heldout
        acc, data = self.summary.get(f"final_{split}_acc"), self.sim.dataset
        if acc is None or not at_chance(acc, data.num_classes, int(data.x_test.shape[0])):
            return
        text = (f"the final {split} accuracy {acc:.4f} is at chance level (1/{data.num_classes} = "
                f"{1 / data.num_classes:.4f}): the model learned nothing or collapsed (try a smaller train.lr, "
                "train.clip, or more rounds)")
        self.summary["warnings"] = [*self.summary.get("warnings", []), text]
        print(f"fedflat: warning: {text}", file=sys.stderr, flush=True)

    def _save_summary(self) -> None:
        if self.run_dir is not None:
            self.run_dir.write_summary(self.summary)

    def _save(self) -> None:
        self.summary.update(self.callbacks.run.notes)
        if self.run_dir is None:
            return
        self.run_dir.save_model(cpu_state(self.sim.server.model_state()))  # (a GPU run's model.pt loads anywhere)
        save_personal_parts(self.run_dir.path, self.sim, self.summary["rounds"])  # what a personalized number needs
        self.run_dir.write_summary(self.summary)

    def history(self) -> History:
        return History(metrics=self.metrics, summary=self.summary, config=self.resolved,
                       final_parameters=self.sim.server.w.detach().cpu().clone(),
                       run_dir=self.run_dir.path if self.run_dir else None,
                       state_dict=cpu_state(self.sim.server.model_state()))


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` on the CPU, as :attr:`History.final_parameters` and ``model.pt`` are, whatever the run's device."""
    return {k: v.detach().cpu() for k, v in state.items()}


def at_chance(acc: float, num_classes: int, count: int) -> bool:
    """Whether accuracy ``acc`` on ``count`` held-out samples is at chance level: within three binomial standard
    errors of ``p = 1/num_classes``, ``|acc - p| <= 3 sqrt(p (1 - p) / count)``. A model that guesses (or, on a
    balanced held-out set, predicts one class) scores ``p`` up to that sampling error; one that learned anything
    beyond it is more than 3 standard errors away (0.009 on Fashion-MNIST's 10,000 test images)."""
    p = 1.0 / num_classes
    return count > 0 and abs(acc - p) <= 3.0 * math.sqrt(p * (1.0 - p) / count)


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
