"""fedflat's loggers, chosen by the config key ``loggers`` (docs/experiments.md, "Tracking runs").

Each is a :class:`~fedflat.experiments.callbacks.Callback` recording the resolved config and exactly the
metrics lines of ``metrics.jsonl`` (step = round), and the summary at the end:

- ``tensorboard``: scalars, the config as text and as hparams, into ``RUN_DIR/tensorboard``;
- ``csv``: ``RUN_DIR/metrics.csv``, one row per metrics line (a column per key);
- ``wandb``: a Weights & Biases run (``RUN_DIR/wandb/`` by default; ``mode: offline`` for ``wandb sync`` later);
- ``mlflow``: an MLflow run in a tracking store (``tracking_uri``, e.g. ``sqlite:///runs/mlflow.db``), the config
  as params.

A run tracked by W&B or MLflow keeps the tracked run's id in ``RUN_DIR/tracking.json``, so a resumed run
continues the same tracked run and never logs a round twice; the cells of a sweep or tune study are grouped by
its name (W&B group, MLflow experiment). A logger's library is checked before the run folder is made
(:func:`build_loggers`); the callbacks' rules say what a failure costs (nothing of the run's results).
"""
from __future__ import annotations

import csv
import io
import json
import math
import numbers
import os
import secrets
import string
import sys
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterator

from fedflat.config import LOGGER_CONFIGS, LoggerConfig, MLflowLogger, WandbLogger, dump_yaml
from fedflat.experiments.callbacks import Callback, CallbackError, CallbackWarning, RunInfo
from fedflat.experiments.report import flatten
from fedflat.experiments.rundir import FINISHED, TRACKING_FILE
from fedflat.files import atomic_write_text


class LoggerUnavailable(CallbackError):
    """A logger's library is not installed."""


# A call to a tracking service that takes longer than this says on stderr what it waits for.
NOTICE_SECONDS = 5.0


@contextmanager
def waiting(what: str, bound: float) -> Iterator[None]:
    """Runs the block; if it takes over :data:`NOTICE_SECONDS`, stderr says what it waits for and how long at
    most (``bound`` seconds, from the logger's ``timeout``)."""
    notice = threading.Timer(NOTICE_SECONDS, lambda: print(
        f"fedflat: waiting for {what} (at most about {bound:.0f} s: the logger's timeout option)", file=sys.stderr,
        flush=True))
    notice.daemon = True
    notice.start()
    try:
        yield
    finally:
        notice.cancel()


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a metrics line (or summary) as floats, nested mappings as ``a.b`` (not bools)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}."))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def hyperparameters(config: dict[str, Any]) -> dict[str, str | float | int | bool]:
    """The resolved config as flat ``section.key`` parameters: numbers and booleans kept, the rest as text."""
    out: dict[str, str | float | int | bool] = {}
    for key, value in flatten(config).items():
        if isinstance(value, (bool, int, float, str)):
            out[key] = value
        else:
            out[key] = json.dumps(list(value) if isinstance(value, tuple) else value, default=str)
    return out


def tracked(run_dir: Path | None, logger: str) -> dict[str, Any]:
    """What ``run_dir/tracking.json`` records of ``logger``'s tracked run ({} when nothing)."""
    if run_dir is None:
        return {}
    try:
        return json.loads((run_dir / TRACKING_FILE).read_text()).get(logger, {})
    except (OSError, ValueError):
        return {}


def record_tracked(run_dir: Path | None, logger: str, **fields: Any) -> None:
    """Updates ``logger``'s entry of ``run_dir/tracking.json`` (written atomically)."""
    if run_dir is None:
        return
    path = run_dir / TRACKING_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    state[logger] = {**state.get(logger, {}), **fields}
    atomic_write_text(path, json.dumps(state, indent=2) + "\n")


class Logger(Callback):
    """A logger of the config key ``loggers``: ``name``, the module it needs and the extra that installs it."""

    name: ClassVar[str]
    module: ClassVar[str | None] = None
    extra: ClassVar[str] = ""
    needs_folder: ClassVar[bool] = False

    def __init__(self, options: LoggerConfig):
        self.options = options
        self.optional = options.optional

    @classmethod
    def require(cls) -> None:
        """Raises :class:`LoggerUnavailable` (with the install line) unless the library imports."""
        if cls.module is None:
            return
        try:
            __import__(cls.module)
        except ImportError as err:
            raise LoggerUnavailable(f"the {cls.name} logger needs the '{cls.module}' package ({err}): pip install "
                                    f"'fedflat[{cls.extra}]', or drop {cls.name} from loggers") from None

    def prepare(self, group: str | None = None) -> None:
        """Checks what can be checked before any run starts (the library; a tracking store)."""
        self.require()

    def on_log(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        """The line of a round not evaluated (its parts logged values): recorded as an evaluated round's is."""
        self.on_evaluation(run, round, metrics)

    def on_run_start(self, run: RunInfo) -> None:
        if self.needs_folder and run.run_dir is None:
            raise CallbackError(f"the {self.name} logger writes into the run folder: run with save=True")


class TensorBoardLogger(Logger):
    """Scalars at step = round into ``RUN_DIR/tensorboard``; on a new log the config as text and as hparams
    (the hparams dashboard relates them to the held-out accuracy and loss). A resume purges events of rounds
    after its checkpoint, so every round appears once."""

    name, module, extra, needs_folder = "tensorboard", "tensorboard", "tensorboard", True

    def on_run_start(self, run: RunInfo) -> None:
        super().on_run_start(run)
        self.require()
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = run.run_dir / "tensorboard"
        fresh = not folder.exists()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=run.start_round + 1 if run.start_round else None)
        if fresh:
            self.writer.add_text("config", "```yaml\n" + dump_yaml(run.config) + "```", 0)
            split = "val" if run.config.get("data", {}).get("validation") else "test"
            metrics = {f"{split}_acc": 0, f"{split}_loss": 0}  # the hparams dashboard reads their scalars
            experiment, start, self.session_end = hparams(hyperparameters(run.config), metrics)
            self.writer.file_writer.add_summary(experiment)
            self.writer.file_writer.add_summary(start)
            for line in run.metrics:  # a logger added to a resumed run starts with the lines so far
                self._scalars(line)
        self.writer.flush()

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        self._scalars(metrics)
        self.writer.flush()

    def _scalars(self, line: dict[str, Any]) -> None:
        for key, value in scalars(line).items():
            if key != "round":
                self.writer.add_scalar(key, value, line["round"])

    def on_run_end(self, run: RunInfo, summary: dict[str, Any], status: str) -> None:
        self.writer.add_text("summary", "```json\n" + json.dumps(summary, indent=2, default=str) + "\n```",
                             summary.get("rounds", 0))
        if status in FINISHED and getattr(self, "session_end", None) is not None:
            self.writer.file_writer.add_summary(self.session_end)  # the hparams session's end (success)
        self.writer.close()


class CSVLogger(Logger):
    """``RUN_DIR/metrics.csv``: one row per metrics line, a column per key (``round`` first, nested keys as
    ``a.b``). A new key rewrites the file with the wider header; a resume rewrites it to its checkpoint's
    lines, as ``metrics.jsonl``."""

    name, needs_folder = "csv", True

    def on_run_start(self, run: RunInfo) -> None:
        super().on_run_start(run)
        self.path = run.run_dir / "metrics.csv"
        self.rows = [self._row(line) for line in run.metrics]
        self.columns: list[str] = ["round"]
        self._rewrite()

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        row = self._row(metrics)
        self.rows.append(row)
        if any(key not in self.columns for key in row):
            self._rewrite()
            return
        with open(self.path, "a", newline="") as fh:
            csv.DictWriter(fh, self.columns, lineterminator="\n").writerow(row)

    @staticmethod
    def _row(line: dict[str, Any]) -> dict[str, Any]:
        return {k: json.dumps(list(v)) if isinstance(v, tuple) else v for k, v in flatten(line).items()}

    def _rewrite(self) -> None:
        for row in self.rows:
            self.columns += [key for key in row if key not in self.columns]
        text = io.StringIO()
        writer = csv.DictWriter(text, self.columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.path, text.getvalue())


class _Tracker(Logger):
    """A tracking service's logger: its run id kept in ``tracking.json``, so that a resume continues the same
    tracked run; rounds up to ``logged`` (what the tracked run already holds) are not logged again."""

    logged = 0

    def on_run_start(self, run: RunInfo) -> None:
        super().on_run_start(run)
        self.require()
        self.run_dir = run.run_dir
        self.open(run, tracked(run.run_dir, self.name))
        for line in run.metrics:  # a resume's lines the tracked run lacks (all of them for a logger added now)
            self._log(line)

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        self._log(metrics)

    def _log(self, line: dict[str, Any]) -> None:
        if line["round"] <= self.logged:
            return
        self.log({k: v for k, v in scalars(line).items() if k != "round"}, line["round"])
        self.logged = line["round"]

    def open(self, run: RunInfo, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError


class WandbTracker(_Tracker):
    """A W&B run: the resolved config as its config, the metrics lines at step = round, the summary's numbers
    (``summary.*``), status and reason in its summary; named after the run folder, grouped by sweep. Its id,
    drawn before the run starts and kept in ``tracking.json``, makes a resume continue it (``resume="allow"``):
    offline, each process writes an ``offline-run-*-ID`` folder and ``wandb sync`` joins them into one run.
    W&B writes through a process of its own that a killed run can take down before it wrote what it was sent,
    so a resume logs the lines of its checkpoint again: W&B keeps the first value of a step and drops a step
    below the run's last, so each round is held once whatever the kill lost."""

    name, module, extra = "wandb", "wandb", "wandb"
    options: WandbLogger

    def open(self, run: RunInfo, state: dict[str, Any]) -> None:
        import wandb

        o = self.options
        run_id = state.get("id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        record_tracked(run.run_dir, self.name, id=run_id)
        folder = Path(o.dir) if o.dir else run.run_dir
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            writable(folder)
        settings = wandb.Settings(console="off", quiet=True, silent=True, init_timeout=3 * o.timeout,
                                  x_graphql_timeout_seconds=o.timeout)
        with waiting("W&B to start its run", 3 * o.timeout):
            self.run = wandb.init(project=o.project, entity=o.entity, id=run_id, resume="allow", name=run.name,
                                  group=run.group, job_type=run.job, tags=o.tags or None, config=run.config,
                                  dir=str(folder) if folder is not None else None, mode=o.mode, reinit="create_new",
                                  settings=settings)
        wrote = Path(self.run.settings.root_dir)
        record_tracked(run.run_dir, self.name, id=run_id, dir=str(wrote.absolute()))
        if folder is not None and wrote.absolute() != folder.absolute():  # W&B's own fallback (a temp folder)
            warnings.warn(f"wandb writes into {wrote}, not {folder} (recorded in tracking.json)", CallbackWarning,
                          stacklevel=2)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def on_run_end(self, run: RunInfo, summary: dict[str, Any], status: str) -> None:
        if getattr(self, "run", None) is None:
            return
        self.run.summary.update({**scalars(summary, "summary."), "status": status,
                                 "reason": summary.get("reason") or ""})
        with waiting("W&B to finish its run", 3 * self.options.timeout):
            self.run.finish(exit_code=0 if status in FINISHED else 1)


def writable(folder: Path) -> None:
    """A :class:`CallbackError` unless ``folder`` can be read and written (W&B's own test of its ``dir``)."""
    if not os.access(folder, os.W_OK | os.R_OK | os.X_OK):
        raise CallbackError(f"wandb: its dir {folder} is not writable: give the logger a writable dir, or none (the "
                            "run folder)")


class MLflowTracker(_Tracker):
    """An MLflow run in the tracking store ``tracking_uri``: the resolved config as params (``section.key``),
    the metrics lines at step = round, the summary's numbers as ``summary.*`` metrics and its status as the run's
    (FINISHED for completed or diverged, KILLED when interrupted, FAILED otherwise) with tags
    ``fedflat.status``/``fedflat.reason``. The experiment is ``experiment``, else the sweep's name, else
    'fedflat'; tags name the run folder, group and job."""

    name, module, extra = "mlflow", "mlflow", "mlflow"
    options: MLflowLogger

    def prepare(self, group: str | None = None) -> None:
        """Opens the store (an SQLite store's tables are made here, once, before a sweep's cells start) and
        makes the experiment."""
        self.require()
        try:
            with self.bounded():
                self._experiment(self._client(), group)
        except Exception as err:  # noqa: BLE001 - any store failure is the one-line message
            detail = str(err).splitlines()[0] if str(err) else ""
            raise CallbackError(f"mlflow: the tracking store {self._uri()} cannot be used: {type(err).__name__}: "
                                f"{detail}") from None

    @contextmanager
    def bounded(self) -> Iterator[None]:
        """MLflow's HTTP requests within the logger's ``timeout``: each attempt waits at most ``timeout`` seconds
        to connect and to be answered, 3 attempts, 0 then 2 s apart (MLflow's own defaults: 120 s, 7 retries with
        a doubling backoff, over 4 minutes of silence for an unreachable server); a call taking over
        :data:`NOTICE_SECONDS` says what it waits for."""
        timeout = self.options.timeout
        limits = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout))),
                  "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
        before = {key: os.environ.get(key) for key in limits}
        os.environ.update(limits)
        try:
            with waiting(f"the MLflow tracking store {self._uri()}", 3 * math.ceil(timeout) + 2):
                yield
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def on_run_start(self, run: RunInfo) -> None:
        with self.bounded():
            super().on_run_start(run)

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        with self.bounded():
            super().on_evaluation(run, round, metrics)

    def _uri(self) -> str:
        """The store's URI; a relative SQLite or file path made absolute (a resume elsewhere finds it)."""
        import mlflow

        uri = self.options.tracking_uri or mlflow.get_tracking_uri()
        for scheme in ("sqlite:///", "file://"):
            rest = uri[len(scheme):] if uri.startswith(scheme) else None
            if rest is not None and not rest.startswith("/"):
                return scheme + str(Path(rest).absolute())
        if "://" not in uri:
            return str(Path(uri).absolute())
        return uri

    def _client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self._uri())

    def _experiment(self, client, group: str | None) -> str:
        from mlflow.exceptions import MlflowException

        name = self.options.experiment or group or "fedflat"
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(name)
        except MlflowException:  # made meanwhile by another cell of the sweep
            return client.get_experiment_by_name(name).experiment_id

    def open(self, run: RunInfo, state: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunStatus

        self.client, uri = self._client(), self._uri()
        if state.get("run_id") and state.get("tracking_uri") == uri:
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            history = self.client.get_metric_history(self.run_id, "train_loss")
            self.logged = max((m.step for m in history), default=0)
            self.client.set_tag(self.run_id, "fedflat.resumed_at", str(run.start_round))
            return
        uid = state.get("uid") or uuid.uuid4().hex
        record_tracked(run.run_dir, self.name, uid=uid, tracking_uri=uri)
        experiment = self._experiment(self.client, run.group)
        earlier = self.client.search_runs([experiment], f"tags.`fedflat.uid` = '{uid}'") if state.get("uid") else []
        tags = {"fedflat.uid": uid, "fedflat.run_dir": str(run.run_dir.absolute()) if run.run_dir else "",
                **({"fedflat.group": run.group} if run.group else {}),
                **({"fedflat.job": run.job} if run.job else {}), **self.options.tags}
        if earlier:  # made by a process killed before it could record the id
            self.run_id = earlier[0].info.run_id
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value)
        else:
            self.run_id = self.client.create_run(experiment, run_name=run.name, tags=tags).info.run_id
        record_tracked(run.run_dir, self.name, run_id=self.run_id, tracking_uri=uri, experiment_id=experiment)
        params = [Param(k, str(v)[:6000]) for k, v in hyperparameters(run.config).items()]
        for lo in range(0, len(params), 100):  # (logging a param again with its value is allowed)
            self.client.log_batch(self.run_id, params=params[lo:lo + 100])
        self.logged = 0

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def on_run_end(self, run: RunInfo, summary: dict[str, Any], status: str) -> None:
        if getattr(self, "run_id", None) is None:
            return
        with self.bounded():
            self._end(summary, status)

    def _end(self, summary: dict[str, Any], status: str) -> None:
        from mlflow.entities import Metric, RunStatus

        now, step = int(time.time() * 1000), int(summary.get("rounds") or 0)
        values = {k: v for k, v in scalars(summary, "summary.").items() if math.isfinite(v)}
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
        self.client.set_tag(self.run_id, "fedflat.status", status)
        self.client.set_tag(self.run_id, "fedflat.reason", str(summary.get("reason") or "")[:5000])
        interrupted = str(summary.get("reason") or "").startswith("interrupted")
        final = "FINISHED" if status in FINISHED else "KILLED" if interrupted else "FAILED"
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(RunStatus.from_string(final)))


LOGGERS: dict[str, type[Logger]] = {cls.name: cls for cls in (TensorBoardLogger, CSVLogger, WandbTracker,
                                                                MLflowTracker)}
assert set(LOGGERS) == set(LOGGER_CONFIGS), "every logger of the config has a class here"


def build_loggers(entries: list[LoggerConfig], group: str | None = None) -> list[Logger]:
    """The loggers of the config key ``loggers``, each checked (:meth:`Logger.prepare`) before a run folder is
    made: a failure is a :class:`CallbackError` saying what to do, or, for an optional logger, a warning and
    the logger left out."""
    loggers = []
    for entry in entries:
        logger = LOGGERS[entry.name](entry)
        try:
            logger.prepare(group)
        except CallbackError as err:
            if not entry.optional:
                raise
            warnings.warn(f"{err}; the run goes on without it (optional)", CallbackWarning, stacklevel=2)
            continue
        loggers.append(logger)
    return loggers


__all__ = ["LOGGERS", "CSVLogger", "Logger", "LoggerUnavailable", "MLflowTracker", "TRACKING_FILE",
           "TensorBoardLogger", "WandbTracker", "build_loggers", "record_tracked", "tracked"]
