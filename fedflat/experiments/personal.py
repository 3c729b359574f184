"""A personalized run's personal parts on disk (``personal.pt``), and ``fedflat evaluate``, which reproduces a run's
reported accuracy from its folder.

A personalized method (FedPer, FedBN, FedRep, Ditto, APFL) reports its clients' own models on their own test shares;
``model.pt`` alone is the global model, which scores something else (FedBN's global BatchNorm is the initial one).
So a personalized run also writes ``personal.pt`` beside ``model.pt``: for each client state vector the personalized
evaluation reads (``Personalization.kept()``, and the clients' buffers where they keep some: FedBN's statistics),
the rows of the clients that have one. It is a plain dict of tensors (``torch.load(path, weights_only=True)``)::

    {"format": 1, "round": R, "algorithm": "fedbn", "num_clients": N,
     "state": {name: {"clients": int64 [M], "rows": [M, width]}}}

where a method keeps only some entries of the model private (FedPer's head, FedBN's BatchNorm), a model row holds just
those (``"entries"``: their indices in the model's flat vector, ``"size"``: its length ``P``).

``fedflat evaluate RUN`` (:mod:`fedflat.experiments.commands`) rebuilds the run's data, split and model from
``config.yaml``, loads ``model.pt`` (and ``personal.pt``) and evaluates them as the run's last evaluation did: the
same numbers as ``summary.json``'s final accuracy and loss for a run whose last round was evaluated (every completed
run).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from fedflat.core import BUFFERS, ConfigError
from fedflat.engine.simulation import PERSONAL_EVAL_ENTRIES
from fedflat.files import atomic_torch_save

PERSONAL_FILE = "personal.pt"
FORMAT = 1


def evaluated_state(sim) -> list[str]:
    """The client state vectors a personalized evaluation of ``sim`` reads."""
    names = list(sim.algorithm.parts["personalization"].kept())
    return names + ([BUFFERS] if sim.private_buffers is not None else [])


def personal_parts(sim, rounds: int) -> dict[str, Any] | None:
    """``personal.pt``'s content for ``sim`` after ``rounds`` rounds, or None: not personalized, or a federation
    (whose personal parts stay on its nodes). Where the method keeps some entries of the model private (FedPer's
    head, FedBN's BatchNorm), a kept model row holds only those entries (``entries``: their indices; ``size``: the
    row's length), which is all its personalized model reads of it; otherwise (Ditto, APFL) whole rows."""
    if not sim.personalized or sim.personal_evaluation is not None:
        return None
    personalization = sim.algorithm.parts["personalization"]
    mask = personalization.private(sim.settings)
    entries = mask.nonzero().squeeze(1).cpu() if mask is not None and bool(mask.any()) else None
    names, model_rows = evaluated_state(sim), set(personalization.kept())
    clients: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    per_chunk = max(1, PERSONAL_EVAL_ENTRIES // max(1, sim.num_parameters))  # client rows held at once
    for lo in range(0, sim.cfg.data.num_clients, per_chunk):
        ids = torch.arange(lo, min(lo + per_chunk, sim.cfg.data.num_clients))
        state, known = sim.server.load_state(ids, names)
        for name in names:
            rows_of = state[name]  # (on a GPU run the store's rows and its mask may sit on different devices)
            kept = rows_of[known[name].to(rows_of.device)].cpu()  # only the known rows leave the device
            rows[name].append(kept[:, entries] if entries is not None and name in model_rows else kept.clone())
            clients[name].append(ids[known[name].cpu()])
    state = {}
    for name in names:
        state[name] = {"clients": torch.cat(clients[name]), "rows": torch.cat(rows[name])}
        if entries is not None and name in model_rows:
            state[name].update(entries=entries, size=sim.num_parameters)
    return {"format": FORMAT, "round": rounds, "algorithm": sim.algorithm.label,
            "num_clients": sim.cfg.data.num_clients, "state": state}


def save_personal_parts(run_dir: Path, sim, rounds: int) -> None:
    """Writes ``personal.pt`` (atomically) where the run is personalized; nothing otherwise."""
    parts = personal_parts(sim, rounds)
    if parts is not None:
        atomic_torch_save(Path(run_dir) / PERSONAL_FILE, parts)


def state_loader(parts: dict[str, Any]) -> Callable[[torch.Tensor, list[str]], tuple[dict, dict]]:
    """``load_state(ids, names)`` over ``personal.pt``'s rows (zeros and ``known = False`` for a client without)."""
    def load_state(ids: torch.Tensor, names: list[str]) -> tuple[dict, dict]:
        state, known = {}, {}
        for name in names:
            if name not in parts["state"]:
                raise ConfigError(f"{PERSONAL_FILE} holds no '{name}' (it has {sorted(parts['state'])}): it was "
                                  "written for another method than this config's")
            saved = parts["state"][name]
            where = {int(c): r for r, c in enumerate(saved["clients"].tolist())}
            entries = saved.get("entries")
            width = saved["rows"].shape[1] if entries is None else int(saved["size"])
            rows = torch.zeros((len(ids), width), dtype=saved["rows"].dtype)
            known[name] = torch.tensor([int(c) in where for c in ids.tolist()], dtype=torch.bool)
            for r, c in enumerate(ids.tolist()):
                if c in where:
                    if entries is None:
                        rows[r] = saved["rows"][where[c]]
                    else:
                        rows[r, entries] = saved["rows"][where[c]]
            state[name] = rows
        return state, known
    return load_state


def evaluate_run(run_dir: str | Path, personalized: bool | None = None, model: str = "model.pt",
                 split: str | None = None, merged: bool = False, **user: Any) -> dict[str, Any]:
    """Evaluates a run folder's saved models as its run did: the clients' own models (``personal.pt`` with
    ``model.pt``) where ``personalized`` (default: where the run's evaluation was personalized), else the global
    ``model`` (``model.pt``, or another model file the run kept: ``best_model.pt``) on the whole held-out set.
    ``split``: ``test`` or ``val`` (default: the split the run evaluated); ``test`` on a run that selected on a
    validation split gives the test accuracy of the model it selected, as ``summary.json``'s ``selected_test_acc``
    (``final_test_acc`` for ``model.pt``). ``merged``: a run of adapters evaluated as the plain model with them
    merged into its base (``W0 + (alpha / r) B A``, what a deployment serves; the same predictions up to float32
    rounding). ``user``: ``dataset=``, ``model_fn=``, ``clients=`` of a run on user
    data. Returns ``{"round", "evaluation", "split", "model", "accuracy", "loss", "reported_accuracy",
    "reported_loss", "reported_key"}``."""
    from fedflat.engine.checkpoint import CheckpointError, run_config
    from fedflat.engine.simulation import Simulation, UserInputs, pooled_accuracy
    from fedflat.files import safe_load

    path = Path(run_dir)
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    if personalized is None:
        personalized = summary.get("evaluation") == "personalized" and model == "model.pt"
    model_file = path / model
    if "/" in model or not model_file.is_file():
        kept = sorted(p.name for p in path.glob("*.pt") if p.name not in ("checkpoint.pt", PERSONAL_FILE))
        raise ConfigError(f"{path}: no model file {model!r} (the run kept {', '.join(kept) or 'none yet'})")
    if merged and personalized:
        raise ConfigError(f"{path}: --merged evaluates the global model with its adapters merged: add --global")
    if personalized and model != "model.pt":
        raise ConfigError(f"{path}: personal.pt holds the clients' parts of the final model.pt only: evaluate "
                          f"{model} with --global")
    if split not in (None, "test", "val"):
        raise ConfigError(f"split {split!r}: choose test or val")
    state = safe_load(model_file, "model file", "restore it from a copy, or run the experiment again")
    # (the files before the config, which may import the run's plugins)
    parts = _personal_file(path) if personalized and (path / PERSONAL_FILE).is_file() else None
    sim = Simulation(run_config(path), UserInputs(**user))
    if split == "val" and sim.heldout != "val":
        raise ConfigError(f"{path}: the run held out no validation split (data.validation): evaluate on test")
    try:
        w, b = sim.model.vectors(state)
    except ValueError as err:
        raise CheckpointError(f"{model_file}: does not match the configured model ({err})") from None
    sim.server.w, sim.server.buffers = w.to(sim.device), b.to(sim.device)
    rounds = summary.get("rounds") if model == "model.pt" else _kept_round(summary, model)
    with sim.on_test_split() if split == "test" else contextlib.nullcontext():
        if personalized:
            if not sim.personalized:
                raise ConfigError(f"{path}: {sim.algorithm.label} keeps nothing on its clients; evaluate it without "
                                  "--personalized")
            parts = parts if parts is not None else _personal_file(path)
            rounds = parts["round"]
            scores = sim.personal_scores(sim.server.w, list(range(sim.cfg.data.num_clients)), state_loader(parts))
            accuracy, loss = pooled_accuracy(scores)
        elif merged:
            accuracy, loss = merged_scores(sim)
        else:
            accuracy, loss = sim.evaluate(sim.server.w)
        split = sim.heldout
    key = _reported_key(summary, split, model, personalized)
    evaluation = "personalized" if personalized else "merged" if merged else "global"
    return {"round": rounds, "evaluation": evaluation, "split": split,
            "model": model, "accuracy": accuracy, "loss": loss, "reported_key": key,
            "reported_accuracy": summary.get(f"{key}_acc") if key else None,
            "reported_loss": summary.get(f"{key}_loss") if key else None}


@torch.no_grad()
def merged_scores(sim) -> tuple[float, float]:
    """``(accuracy, mean loss)`` on the held-out set of the run's global model with its adapters merged into the
    base (:func:`fedflat.models.lora.merge_adapters`; ``sim`` is spent: its base now holds the merged weights)."""
    from fedflat.engine.losses import summed_loss
    from fedflat.models.lora import adapted, merge_adapters

    if adapted(sim.model.module) is None:
        raise ConfigError("--merged: this run trained no adapters (an adapter section): evaluate it without --merged")
    x, y, size = sim.dataset.x_test, sim.dataset.y_test, sim.cfg.eval.batch_size
    with sim.model.materialized(sim.server.w, sim.server.buffers) as module:
        net = merge_adapters(module).eval()
        correct, loss = 0, 0.0
        for lo in range(0, x.shape[0], size):
            logits = net(sim.dataset.features(x[lo:lo + size]))
            correct += int((logits.argmax(1) == y[lo:lo + size]).sum())
            loss += float(summed_loss(sim.settings.loss, logits, y[lo:lo + size]))
    return correct / x.shape[0], loss / x.shape[0]


def _kept_round(summary: dict[str, Any], model: str) -> int | None:
    """The round of a kept model file, as ``summary.json`` records it (``best_model``'s round)."""
    best = summary.get("best_model") or {}
    return best.get("round") if best.get("file") == model else None


def _reported_key(summary: dict[str, Any], split: str, model: str, personalized: bool) -> str | None:
    """The ``summary.json`` numbers (``KEY_acc``, ``KEY_loss``) this evaluation reproduces, or None."""
    if personalized != (summary.get("evaluation") == "personalized"):
        return None
    if split == "test" and summary.get("evaluated_on") == "val" and summary.get("selected_file") == model:
        return "selected_test"
    return f"final_{split}" if model == "model.pt" else None


def _personal_file(path: Path) -> dict[str, Any]:
    file = path / PERSONAL_FILE
    if not file.is_file():
        raise ConfigError(f"{path}: no {PERSONAL_FILE}: the run's personal parts were not saved (a Flower run keeps "
                          "them on its nodes; runs before fedflat wrote the file lack it: `fedflat resume` with "
                          "rounds= one more writes it)")
    from fedflat.engine.checkpoint import safe_load

    parts = safe_load(file, "personal file", "restore it from a copy, or `fedflat resume` the run with rounds= one "
                                             "more to write it again")
    if not isinstance(parts, dict) or parts.get("format") != FORMAT:
        found = parts.get("format") if isinstance(parts, dict) else type(parts).__name__
        raise ConfigError(f"{file}: format {found!r}, this fedflat reads {FORMAT}")
    return parts
