"""FedPer (personalization layers) and the personalized evaluation: the head never reaches the server, a client
trains from its own head, each client is tested on its own share of the test set."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_leaf import femnist

import fedflat
from fedflat.algorithms import AlgorithmError, build_algorithm
from fedflat.algorithms.fedper import PERSONAL_MODEL, private_layers
from fedflat.core import ConfigError
from fedflat.data import client_test_split, load_dataset
from fedflat.engine.simulation import Simulation


def _head(sim: Simulation) -> torch.Tensor:
    return sim.algorithm.parts["personalization"].private(sim.settings).to(sim.device)  # beside the run's tensors


def test_the_private_mask_is_the_last_layers_parameters(tiny):
    sim = Simulation(tiny("algo=fedper"))
    layout = sim.model.layout
    assert layout.names[-2:] == ("head.weight", "head.bias")
    head = private_layers(layout, 1)
    start = layout.offsets[-2]
    assert head[start:].all() and not head[:start].any()
    with pytest.raises(AlgorithmError, match="at least one must stay shared"):
        private_layers(layout, 2)  # the tiny MLP has two layers, body.0 and head


def _round_results(cfg):
    sim = Simulation(cfg)
    opened = sim.server.begin_round(0)
    return sim, opened, sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)


def test_first_round_trains_as_fedavg_keeps_the_model_and_uploads_the_broadcast_head(tiny):
    """Round 1: every client starts from w^0 (no head yet), so local training is FedAvg's; the client keeps its
    final model, uploads w^0's head in its head's place, and the server's head stays w^0's."""
    per, opened, mine = _round_results(tiny("algo=fedper", "rounds=1"))
    avg, _, theirs = _round_results(tiny("algo=fedavg", "rounds=1"))
    head, w0 = _head(per), opened.broadcast.w
    assert torch.equal(mine.state[PERSONAL_MODEL], theirs.upload["model"])
    assert torch.equal(mine.upload["model"], torch.where(head, w0, theirs.upload["model"]))
    assert not torch.equal(theirs.upload["model"][:, head], w0[head].expand(len(mine.ids), -1))  # heads did move
    per.server.finish_round(opened, mine)
    avg.server.finish_round(avg.server.begin_round(0), theirs)
    assert torch.equal(per.server.w[head], w0[head]) and torch.equal(per.server.w[~head], avg.server.w[~head])


def test_a_returning_client_starts_from_its_own_head_and_the_global_base(tiny):
    cfg = tiny("algo=fedper", "rounds=2", "sampling.clients_per_round=6")
    sim = Simulation(cfg)
    sim.run_round(0)
    ids = torch.arange(6)
    state, known = sim.server.load_state(ids)
    assert known[PERSONAL_MODEL].all()
    start = sim.algorithm.parts["personalization"].models(sim.server.w, state, known, sim.settings)
    head = _head(sim)
    assert torch.equal(start[:, head], state[PERSONAL_MODEL][:, head])
    assert torch.equal(start[:, ~head], sim.server.w[~head].expand(6, -1))
    # round 2 trained from those starts: FedAvg run from the same points by hand gives the same uploads
    opened = sim.server.begin_round(1)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    plain = Simulation(tiny("algo=fedavg", "rounds=2", "sampling.clients_per_round=6"))
    from fedflat.core import ClientContext
    from fedflat.engine.client import fit
    from fedflat.engine.runtime import make_cohort
    rows = []
    for c in range(6):
        ctx = ClientContext.of(opened.broadcast, plain.settings, plain.oracle, plain.batches)
        ctx.w_start = start[c]
        cohort = make_cohort(opened.task.rows(torch.tensor([c])), opened.broadcast, plain.server.load_state,
                             plain.device)
        rows.append(fit(plain.algorithm, ctx, cohort).upload["model"][0])
    by_hand = torch.stack(rows)
    torch.testing.assert_close(result.state[PERSONAL_MODEL], by_hand, rtol=0, atol=1e-6)
    torch.testing.assert_close(result.upload["model"], torch.where(head, sim.server.w, by_hand), rtol=0, atol=1e-6)


def test_personalized_evaluation_tests_each_clients_own_model_on_its_own_share(tiny):
    sim = Simulation(tiny("algo=fedper-sam", "rounds=2", "sampling.clients_per_round=4"))
    for t in range(2):
        sim.run_round(t)
    acc, loss = sim.evaluate()
    shares, head = sim.client_tests, _head(sim)
    state, known = sim.server.load_state(torch.arange(6))
    correct = nll = total = 0
    for c, share in enumerate(shares):
        w = torch.where(head, state[PERSONAL_MODEL][c], sim.server.w) if known[PERSONAL_MODEL][c] else sim.server.w
        logits = sim.model(w, sim.dataset.x_test[share])
        correct += int((logits.argmax(1) == sim.dataset.y_test[share]).sum())
        nll += float(torch.nn.functional.cross_entropy(logits, sim.dataset.y_test[share], reduction="sum"))
        total += len(share)
    assert known[PERSONAL_MODEL].sum() < 6  # some client never trained: it is tested with the global model
    assert acc == correct / total and loss == pytest.approx(nll / total, rel=1e-6)
    assert sim.evaluate(sim.server.w) != (acc, loss)  # the global model alone is still there to evaluate
    history = fedflat.run(tiny("algo=fedper-sam", "rounds=2", "sampling.clients_per_round=4"), save=False,
                          progress=False)
    assert history.summary["evaluation"] == "personalized" and history.metrics[-1]["test_acc"] == acc


def test_test_shares_follow_each_clients_labels_and_use_every_sample_once():
    rng = np.random.default_rng(1)
    train, test = rng.integers(0, 4, 400), rng.integers(0, 4, 101)
    clients = [np.flatnonzero(train < 2)[:50], np.flatnonzero(train >= 1)[:120], np.flatnonzero(train == 3)[120:]]
    clients = [np.setdiff1d(c, np.concatenate(clients[:i])) if i else c for i, c in enumerate(clients)]
    shares = client_test_split(train, clients, test, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(shares, client_test_split(train, clients, test, seed=5)))
    assert not all(np.array_equal(a, b) for a, b in zip(shares, client_test_split(train, clients, test, seed=6)))
    together = np.concatenate(shares)
    assert np.unique(together).size == together.size == test.size  # every class is held: every sample used once
    for label in range(4):
        held = np.array([(train[c] == label).sum() for c in clients])
        got = np.array([(test[s] == label).sum() for s in shares])
        expected = held / held.sum() * (test == label).sum()
        assert np.all(np.abs(got - expected) < 1) and got.sum() == (test == label).sum()
        assert np.all(got[held == 0] == 0)
    nobody = client_test_split(train, [np.flatnonzero(train == 0)], test, seed=5)[0]
    assert set(test[nobody]) == {0} and nobody.size == (test == 0).sum()


def test_leaf_clients_are_tested_on_their_own_writers_test_samples(tmp_path):
    femnist(tmp_path)
    data = load_dataset("femnist", root=tmp_path)
    names = data.owner_names
    assert data.test_owners is not None and set(data.test_owners.tolist()) == {0, 1, 2}
    # the test file lists its users in another order than the training files: owners follow the names
    sizes = dict(zip(["f0001_0", "f0007_1", "f0042_2"], (5, 3, 8)))
    assert [int((data.test_owners == names.index(u)).sum()) for u in sizes] == list(sizes.values())
    cfg = ["data=femnist", f"data.root={tmp_path}", "data.num_clients=3", "data.partition=natural", "model=cnn",
           "rounds=1", "threads=1", "sampling.clients_per_round=3", "train.batch_size=4", "algo=fedper"]
    from fedflat.config import load_config
    sim = Simulation(load_config(None, cfg))
    for client, share in zip(sim.client_indices_np, sim.client_tests):
        assert set(data.test_owners[share.cpu().numpy()]) == set(data.owners[client])
    assert sum(len(s) for s in sim.client_tests) == len(data.y_test)


def test_engines_agree_on_a_personalized_run(tiny):
    base = ("algo=fedper-fft", "rounds=3", "train.batch_size=7", "train.local_epochs=2")
    seq = fedflat.run(tiny(*base, "engine=sequential"), save=False, progress=False)
    vec = fedflat.run(tiny(*base, "engine=vectorized"), save=False, progress=False)
    torch.testing.assert_close(vec.final_parameters, seq.final_parameters, rtol=1e-4, atol=1e-5)
    for a, b in zip(seq.metrics, vec.metrics, strict=True):
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=1e-9)


def test_personalization_composes_with_any_method_and_checks_its_layers(tiny):
    algo = build_algorithm({"name": "fedlesam", "personalization": "fedper", "personal_layers": 2})
    assert algo.label == "fedlesam[personalization=fedper]" and "fedper.w_i" in algo.state_keys()
    history = fedflat.run(tiny("algo=scaffold", "algo.personalization=fedper", "rounds=2"), save=False, progress=False)
    assert history.summary["status"] == "completed" and history.summary["evaluation"] == "personalized"
    with pytest.raises(ConfigError, match="personal_layers"):
        fedflat.run(tiny("algo=fedper", "algo.personal_layers=0"), save=False, progress=False)
    with pytest.raises(ConfigError, match="at least one must stay shared"):
        fedflat.run(tiny("algo=fedper", "algo.personal_layers=5"), save=False, progress=False)


def test_report_marks_a_personalized_evaluation(tiny, tmp_path):
    from fedflat.experiments.report import build_rows, find_runs

    fedflat.run(tiny("algo=fedper", "rounds=1"), out=tmp_path, progress=False)
    fedflat.run(tiny("algo=fedavg", "rounds=1"), out=tmp_path, progress=False)
    methods = sorted(row.method for row in build_rows(find_runs([tmp_path]), []))
    assert methods == ["FedAvg", "FedPer (personalized eval)"]
