"""A run's account: the summary (``summary.json``) the :class:`~fedflat.experiments.runner.Runner` keeps as it goes.

:class:`RunSummary` holds the summary dict and everything that writes it: each round's account (communication,
dropped and rejected clients, the privacy budget), each evaluation's best and final numbers, the end status, the
test split's numbers of a run that selected on a validation split, the at-chance warning, and the model and summary
saved at the end; on a full disk it records the failure in the space the reserve gives back.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from fedflat.config import Config
from fedflat.engine.simulation import RoundResult, Simulation
from fedflat.experiments.callbacks import Callbacks, ModelCheckpoint, RunInfo
from fedflat.experiments.personal import save_personal_parts
from fedflat.experiments.report import at_chance
from fedflat.experiments.rundir import DiskFull, RunDir, machine_info, versions
from fedflat.models.lora import adapted, frozen_count, save_adapter

NOW = "%Y-%m-%dT%H:%M:%S%z"
ADAPTER_FOLDER = "adapter"  # a run's adapters in peft's format (adapter_config.json, adapter_model.safetensors)


def initial_summary(cfg: Config, sim: Simulation, resolved: dict[str, Any]) -> dict[str, Any]:
    """What ``summary.json`` holds before round 0: the run's setting, and its counters at zero."""
    alg = sim.algorithm
    summary: dict[str, Any] = {
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
        # what an accuracy is out of: its chance level, and one held-out sample's worth (the report states both)
        "num_classes": sim.dataset.num_classes, **heldout_samples(sim),
        "final_test_acc": None, "best_test_acc": None, "best_round": None,
        "final_test_loss": None,
        **({"final_val_acc": None, "best_val_acc": None, "final_val_loss": None} if sim.heldout == "val" else {}),
        "wall_seconds": 0.0, "train_seconds": 0.0, "eval_seconds": 0.0,
        "versions": versions(), "machine": machine_info(), "started": time.strftime(NOW),
    }
    if sim.server.privacy is not None:
        summary.update(privacy=sim.server.privacy.describe(), epsilon=0.0)
    if sim.report.base_hash is not None:  # a frozen base (adapters): which one, so a node or a rerun can check it
        summary.update(base_hash=sim.report.base_hash, frozen_parameters=frozen_count(sim.model.module))
        if cfg.adapter is not None:
            summary["adapter"] = resolved.get("adapter")
    return summary


def heldout_samples(sim: Simulation) -> dict[str, int]:
    """``{"test_samples": n}``, and ``"val_samples"`` too for a run that selects on ``data.validation``: the size
    of each held-out split an accuracy of the run is computed on."""
    sizes = {f"{sim.heldout}_samples": int(sim.dataset.y_test.shape[0])}
    if sim.problem.test_split is not None:
        sizes["test_samples"] = int(sim.problem.test_split[1].shape[0])
    return sizes


class RunSummary:
    """The summary of one run (``self.summary``, what ``summary.json`` and :attr:`History.summary` hold), kept up
    to date round by round and written to the run folder (None with ``save=False``)."""

    def __init__(self, cfg: Config, sim: Simulation, resolved: dict[str, Any], run_dir: RunDir | None,
                 job: str | None = None):
        self.cfg, self.sim, self.run_dir, self.job = cfg, sim, run_dir, job
        self.summary = initial_summary(cfg, sim, resolved)
        self.checkpointed = 0  # the round of the checkpoint on disk (a resume starts from it)

    def restore(self, saved: dict[str, Any], start_round: int) -> None:
        """Continues the summary of a checkpoint (counters, best numbers; wall time adds up) from ``start_round``."""
        self.checkpointed = start_round
        s = self.summary
        s.update({k: v for k, v in saved.items() if k not in ("versions", "machine", "threads", "warnings")})
        s.update(status="running", reason=None, rounds_planned=self.cfg.rounds)  # rounds= may extend
        self._note_thread_change(saved.get("threads"), start_round)
        s["resumed"] = [*saved.get("resumed", []), {"round": start_round, "at": time.strftime(NOW)}]

    def _note_thread_change(self, before: dict[str, Any] | None, start_round: int) -> None:
        """A resume on other torch thread counts than the run so far (``threads=``, ``executor.*``, or ``auto`` with
        another core share) continues it correctly, but a reduction split over other threads rounds differently:
        the numbers from here on may differ in the last bits from an uninterrupted run's. Said, and recorded."""
        now = self.summary["threads"]
        if before is None or before == now:  # (a checkpoint of an older fedflat does not say)
            return
        self.summary["threads_changed"] = [*self.summary.get("threads_changed", []),
                                           {"round": start_round + 1, "from": before, "to": now}]
        text = lambda counts: ", ".join(f"{k} {v}" for k, v in counts.items())  # noqa: E731
        print(f"fedflat: warning: the run trained on torch threads ({text(before)}), this resume on ({text(now)}): "
              f"from round "
              f"{start_round + 1} on its numbers may differ in the last bits from an uninterrupted run's "
              "(recorded in summary.json as threads_changed)", file=sys.stderr)

    def account(self, result: RoundResult) -> None:
        """A committed round's account: its count, times, communication, left-out clients, privacy budget."""
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

    def evaluated(self, t: int, acc: float, loss: float, extra: dict[str, Any], eval_seconds: float) -> None:
        """Round ``t``'s evaluation: its time, the best accuracy so far, the final numbers (``extra``: eval.metrics,
        keyed by split)."""
        s, split = self.summary, self.sim.heldout
        s["eval_seconds"] += eval_seconds
        if s[f"best_{split}_acc"] is None or acc > s[f"best_{split}_acc"]:
            s[f"best_{split}_acc"], s["best_round"] = acc, t + 1
        s[f"final_{split}_acc"], s[f"final_{split}_loss"] = acc, loss
        s.update({f"final_{k}": v for k, v in extra.items()})

    def note_deaths(self, t: int) -> None:
        """Ray workers that died in round ``t`` (their clients were trained again): summary.json's
        ``worker_deaths`` and a warning on stderr."""
        take = getattr(getattr(self.sim, "executor", None), "take_deaths", None)
        for death in take() if take is not None else []:
            self.summary.setdefault("worker_deaths", []).append({"round": t + 1, **death})
            again = (f"its {death['clients']} clients trained again on worker {death['redone_on']}"
                     if "redone_on" in death else "no worker was left")
            print(f"fedflat: warning: Ray worker {death['worker']} died in round {t + 1} ({death['error']}); "
                  f"{again} (recorded in summary.json)", file=sys.stderr, flush=True)

    def conclude(self, run: RunInfo) -> None:
        """The status of a run whose rounds ended without an error: completed, or stopped when a callback asked to
        (``should_stop``) before the last round; a warning at chance accuracy; the clients a completed run left
        out."""
        s = self.summary
        if run.should_stop and s["rounds"] < self.cfg.rounds:
            s.update(status="stopped", reason=run.stop_reason or "a callback set should_stop")
        else:
            s["status"] = "completed"
        self._warn_at_chance()
        if s["status"] == "completed" and s.get("dropped_clients"):
            s["reason"] = dropped_note(s["dropped_clients"])

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

    def close(self, wall_seconds: float, callbacks: Callbacks) -> None:
        """The run's times, and the errors its callbacks raised (they did not stop it)."""
        self.summary["wall_seconds"] = wall_seconds
        self.summary["finished"] = time.strftime(NOW)
        if callbacks.errors:
            self.summary["callback_errors"] = [*self.summary.get("callback_errors", []), *callbacks.errors]
            callbacks.errors = []

    def test_selection(self, callbacks: Callbacks) -> None:
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
        kept = next((cb for cb in callbacks.active if isinstance(cb, ModelCheckpoint)
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

    def disk_full(self, err: OSError) -> DiskFull:
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

    def write(self) -> None:
        """summary.json as the summary stands."""
        if self.run_dir is not None:
            self.run_dir.write_summary(self.summary)

    def save(self, callbacks: Callbacks) -> None:
        """The end of a run on disk: model.pt, a personalized run's clients' parts, and summary.json (with the
        notes the callbacks left)."""
        self.summary.update(callbacks.run.notes)
        if self.run_dir is None:
            return
        self.run_dir.save_model(cpu_state(self.sim.server.model_state()))  # (a GPU run's model.pt loads anywhere)
        if adapted(self.sim.model.module) is not None:  # peft's own format: PeftModel.from_pretrained loads it
            with self.sim.model.materialized(self.sim.server.w, self.sim.server.buffers) as module:
                save_adapter(module, self.run_dir.path / ADAPTER_FOLDER)
        save_personal_parts(self.run_dir.path, self.sim, self.summary["rounds"])  # what a personalized number needs
        self.run_dir.write_summary(self.summary)


def dropped_note(dropped: dict[str, list[int]]) -> str:
    """What a completed run that left sampled clients out says in its status line and summary's ``reason``."""
    rounds = sorted(dropped, key=int)
    shown = ", ".join(rounds[:10]) + (", ..." if len(rounds) > 10 else "")
    return (f"{sum(map(len, dropped.values()))} sampled clients left out of {len(rounds)} rounds ({shown}): their "
            "nodes failed or did not answer in time; summary.json's dropped_clients names them")


def cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` on the CPU, as :attr:`History.final_parameters` and ``model.pt`` are, whatever the run's device."""
    return {k: v.detach().cpu() for k, v in state.items()}
