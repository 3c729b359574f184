"""Ditto, FedRep and APFL against hand computations of their equations (two rounds, full-batch local steps, so each
step's gradient is the client's full loss gradient, computed with autograd on the model: the engine's oracle,
parts and batching are not used by the reference), their reductions, and the personalized evaluation by hand."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_sam_family import FULL_BATCH, STEPS, Hand, _sampled, close, rounds

import fedflat
from fedflat.algorithms import AlgorithmError, build_algorithm
from fedflat.algorithms.apfl import ALPHA, LOCAL
from fedflat.algorithms.ditto import PERSONAL
from fedflat.algorithms.fedper import PERSONAL_MODEL, private_layers
from fedflat.engine.simulation import Simulation

# Full-batch steps of the hand computations (3 steps, batch larger than any client, no clip, weight decay 0.01);
# float32 through a few dozen operations on O(1) values: close()'s 2e-5 relative, 2e-6 absolute.
HAND = (*FULL_BATCH, "rounds=2", "sampling.clients_per_round=4")


def _row(sim: Simulation, name: str, client: int) -> tuple[torch.Tensor, bool]:
    state, known = sim.server.store.get(name, torch.tensor([client]))
    return state[0], bool(known[0])


def _pooled(sim: Simulation, model_of) -> tuple[float, float]:
    """Accuracy and mean loss of each client's model ``model_of(c)`` on its own test share, pooled."""
    correct = nll = total = 0
    for c, share in enumerate(sim.client_tests):
        logits = sim.model(model_of(c), sim.dataset.x_test[share])
        correct += int((logits.argmax(1) == sim.dataset.y_test[share]).sum())
        nll += float(F.cross_entropy(logits, sim.dataset.y_test[share], reduction="sum"))
        total += len(share)
    return correct / total, nll / total


# ---------------------------------------------------------------- Ditto
@pytest.mark.parametrize("lam", [0.5, 0.0])
def test_ditto_two_rounds_by_hand(tiny, lam):
    """The global model is FedAvg's; each sampled client's v_k takes E proximal steps toward the broadcast on the
    same full batches, v <- v - eta (g(v) + wd v + lam (v - w^t)), from w^t at its first round; the personalized
    evaluation tests every v_k (w where the client never trained) on its own share."""
    sim = Simulation(tiny(*HAND, "algo=ditto", f"algo.lam={lam}"))
    hand = Hand(sim)
    w, v = sim.server.w.clone(), {}
    for t in range(2):
        lr, finals = sim.server.lr_at(t), []
        for i in _sampled(sim, t):
            finals.append(hand.local(w, i, lr))
            p = v.get(i, w)
            for _ in range(STEPS):
                p = p - lr * (hand.grad(p, i) + hand.wd * p + lam * (p - w))
            v[i] = p
        w = torch.stack(finals).mean(0)
    assert set(_sampled(sim, 0)) & set(_sampled(sim, 1)), "the test needs a returning client"
    rounds(sim)
    close(sim.server.w, w)
    for i, p in v.items():
        kept, known = _row(sim, PERSONAL, i)
        assert known
        close(kept, p)
    assert len(v) < 6  # a client that never trained is tested with the global model
    acc, loss = sim.evaluate()
    hand_acc, hand_loss = _pooled(sim, lambda c: _row(sim, PERSONAL, c)[0] if c in v else sim.server.w)
    assert acc == hand_acc and loss == pytest.approx(hand_loss, rel=1e-6)


@pytest.mark.parametrize("ours, theirs", [(("algo=ditto", "algo.lam=2"), ("algo=fedavg",)),
                                          (("algo=ditto", "algo.perturbation=sam", "algo.rho=0.05"),
                                           ("algo=fedsam", "algo.rho=0.05")),
                                          (("algo=apfl", "algo.perturbation=sam", "algo.rho=0.05"),
                                           ("algo=fedsam", "algo.rho=0.05"))])
def test_ditto_and_apfl_leave_the_global_update_as_the_method_it_is_composed_with(tiny, ours, theirs):
    """The personal steps touch neither the global update's batches nor its numbers: Ditto's (APFL's) global model
    is FedAvg's, and with SAM's perturbation swapped in, FedSAM's, bit for bit."""
    mine = fedflat.run(tiny(*ours), save=False, progress=False)
    plain = fedflat.run(tiny(*theirs), save=False, progress=False)
    assert torch.equal(mine.final_parameters, plain.final_parameters)
    assert mine.summary["evaluation"] == "personalized"
    assert mine.summary["backprops_per_step"] == plain.summary["backprops_per_step"] + 1


@pytest.mark.slow  # the BatchNorm CNN: 10 s
def test_dittos_personal_passes_leave_the_batch_norm_statistics_to_the_global_steps(tiny):
    """On a BatchNorm CNN (no dropout) the personal passes come after each step's first pass, which alone updates
    the running statistics: the global parameters and buffers are FedAvg's bit for bit."""
    from conftest import BATCH_NORM_CNN

    ditto = fedflat.run(tiny("algo=ditto", "rounds=2", *BATCH_NORM_CNN), save=False, progress=False)
    avg = fedflat.run(tiny("algo=fedavg", "rounds=2", *BATCH_NORM_CNN), save=False, progress=False)
    assert torch.equal(ditto.final_parameters, avg.final_parameters)
    assert all(torch.equal(ditto.state_dict[k], avg.state_dict[k]) for k in avg.state_dict)
    assert any("running_mean" in k for k in avg.state_dict)


def test_a_large_lambda_holds_dittos_personal_model_near_the_global_one(tiny):
    """lam -> infinity: h_k's minimizer is w^t (Ditto §3): v_k ends far closer to the broadcast than at lam = 0."""
    gaps = []
    for lam in (0.0, 5.0):
        sim = Simulation(tiny(*HAND, "rounds=1", "algo=ditto", f"algo.lam={lam}", "train.lr=0.05"))
        w0 = sim.server.w.clone()
        sim.run_round(0)
        i = _sampled(sim, 0)[0]
        gaps.append(float((_row(sim, PERSONAL, i)[0] - w0).norm()))
    assert gaps[1] < 0.9 * gaps[0]


# ---------------------------------------------------------------- APFL
@pytest.mark.parametrize("adaptive", [True, False])
def test_apfl_two_rounds_by_hand(tiny, adaptive):
    """At each local step k from w_k (FedAvg's iterate): vbar = a v + (1 - a) w_k, g = grad f(vbar);
    a <- clamp(a - eta <v - w_k, g>, 0, 1) (adaptive), v <- v - eta (a g + wd v) with the old a; the global model is
    FedAvg's; the personalized model is a v + (1 - a) w^{t+1}."""
    alpha0 = 0.4
    sim = Simulation(tiny(*HAND, "algo=apfl", f"algo.alpha={alpha0}", f"algo.adaptive={adaptive}"))
    hand = Hand(sim)
    w, v, a = sim.server.w.clone(), {}, {}
    for t in range(2):
        lr, finals = sim.server.lr_at(t), []
        for i in _sampled(sim, t):
            wk, p, al = w.clone(), v.get(i, w), a.get(i, torch.tensor(alpha0))
            for _ in range(STEPS):
                g = hand.grad(al * p + (1 - al) * wk, i)
                new_al = (al - lr * torch.dot(p - wk, g)).clamp(0, 1) if adaptive else al
                p = p - lr * (al * g + hand.wd * p)
                wk = wk - lr * (hand.grad(wk, i) + hand.wd * wk)
                al = new_al
            v[i], a[i] = p, al
            finals.append(wk)
        w = torch.stack(finals).mean(0)
    rounds(sim)
    close(sim.server.w, w)
    for i in v:
        close(_row(sim, LOCAL, i)[0], v[i])
        if adaptive:
            kept = _row(sim, ALPHA, i)[0]
            close(kept, a[i].expand_as(kept))
    if adaptive:
        assert any(abs(float(a[i]) - alpha0) > 1e-4 for i in a)  # alpha moved
    else:
        assert ALPHA not in sim.algorithm.state_keys()
    acc, loss = sim.evaluate()
    hand_acc, hand_loss = _pooled(sim, lambda c: a[c] * v[c] + (1 - a[c]) * sim.server.w if c in v else sim.server.w)
    assert acc == hand_acc and loss == pytest.approx(hand_loss, rel=1e-6)


def test_apfl_with_alpha_zero_fixed_is_fedavg_evaluated_on_the_clients_shares(tiny):
    """alpha = 0, fixed: vbar = w, so the personalized evaluation is FedAvg's global model on every share."""
    sim = Simulation(tiny("algo=apfl", "algo.alpha=0", "algo.adaptive=false"))
    avg = Simulation(tiny("algo=fedavg"))
    rounds(sim, 3)
    rounds(avg, 3)
    assert torch.equal(sim.server.w, avg.server.w)
    acc, loss = sim.evaluate()
    hand_acc, hand_loss = _pooled(avg, lambda c: avg.server.w)
    assert acc == hand_acc and loss == pytest.approx(hand_loss, rel=1e-6)


# ---------------------------------------------------------------- FedRep
def test_fedrep_two_rounds_by_hand(tiny):
    """Each client starts from the global body and its own head (w^0's before its first round), takes
    E - rep_epochs ceil(n/B) head steps (the body frozen), then the body steps (the head frozen); it keeps its head
    and uploads the broadcast's there; the server averages the bodies and its head stays w^0's."""
    sim = Simulation(tiny(*HAND, "algo=fedrep"))
    hand = Hand(sim)
    head = private_layers(sim.model.layout, 1).to(sim.device)  # beside the run's tensors
    w0 = sim.server.w.clone()
    w, heads = sim.server.w.clone(), {}
    body_steps = 1  # full batch: one step per epoch, rep_epochs = 1
    for t in range(2):
        lr, uploads = sim.server.lr_at(t), []
        for i in _sampled(sim, t):
            wk = torch.where(head, heads[i], w) if i in heads else w.clone()
            for k in range(STEPS):
                g = hand.grad(wk, i) + hand.wd * wk
                trained = head if k < STEPS - body_steps else ~head
                wk = wk - lr * torch.where(trained, g, torch.zeros((), device=g.device))
            heads[i] = wk
            uploads.append(torch.where(head, w, wk))
        w = torch.stack(uploads).mean(0)
    rounds(sim)
    close(sim.server.w, w)
    assert torch.equal(sim.server.w[head], w0[head])
    for i, mine in heads.items():
        close(_row(sim, PERSONAL_MODEL, i)[0][head], mine[head])
    acc, loss = sim.evaluate()
    w = sim.server.w
    hand_acc, hand_loss = _pooled(sim, lambda c: torch.where(head, heads[c], w) if c in heads else w)
    assert acc == pytest.approx(hand_acc, abs=1e-12) and loss == pytest.approx(hand_loss, rel=1e-5)


def test_fedreps_phases_follow_each_clients_epochs():
    """Unequal E_i and n_i (batch 7): client i's direction is the gradient on the head only in its first
    E_i - min(E_i, rep_epochs ceil(n_i/7)) steps, on the body only after."""
    from types import SimpleNamespace

    from fedflat.algorithms.fedrep import HEAD, Alternating, AlternatingParams
    from fedflat.core import Cohort, Shared

    head = torch.tensor([False, False, False, True, True])
    n, steps = torch.tensor([20, 7, 3]), torch.tensor([9, 2, 1])  # ceil(n/7) = 3, 1, 1 steps per epoch
    part = Alternating(AlternatingParams(rep_epochs=2))
    cohort = Cohort(ids=torch.arange(3), num_samples=n, steps=steps, active=torch.ones(3, dtype=torch.bool))
    cohort.shared = Shared({HEAD: "personalization 'fedrep'"})
    cohort.shared.put(HEAD, head)
    ctx = SimpleNamespace(settings=SimpleNamespace(batch_size=7, weight_decay=0.0), w_start=torch.zeros(5))
    part.begin(ctx, cohort)
    grad = torch.arange(1.0, 16.0).reshape(3, 5)
    head_steps = [9 - 6, 2 - 2, 1 - 1]  # E_i - min(E_i, 2 ceil(n_i/7))
    for k in range(9):
        d, decay = part.direction(ctx, cohort, k, torch.zeros(3, 5), grad.clone())
        assert decay == 0.0  # the whole masked direction is clipped
        for i in range(3):
            trained = head if k < head_steps[i] else ~head
            assert torch.equal(d[i], torch.where(trained, grad[i], torch.zeros(()))), (i, k)


def test_fedrep_needs_a_head_to_alternate(tiny):
    with pytest.raises(AlgorithmError, match="needs.*fedrep.head.*personalization 'fedrep'"):
        build_algorithm({"name": "fedavg", "correction": "fedrep"})
    assert build_algorithm({"name": "fedrep", "perturbation": "sam"}).label == "fedrep[perturbation=sam]"
    with pytest.raises(AlgorithmError, match="needs.*fedrep.head"):  # the alternation needs FedRep's head
        build_algorithm({"name": "fedrep", "personalization": "fedper"})


# ---------------------------------------------------------------- the personalized number, from the run folder
@pytest.mark.parametrize("algo", ["fedper", pytest.param("fedbn", marks=pytest.mark.slow),  # the BN CNN: 10 s
                                  "fedrep", "ditto", "apfl"])
def test_fedflat_evaluate_reproduces_the_reported_personalized_accuracy_from_the_run_folder(tiny, tmp_path, algo,
                                                                                           capsys):
    """personal.pt (each trained client's kept rows, loadable with weights_only) and model.pt give the summary's
    final personalized accuracy exactly (counts over the same samples) and its loss to float64 summation rounding;
    model.pt alone is the global model, which scores differently (FedBN's issue 47 case: 0.2228 against 0.100)."""
    from fedflat.algorithms import RECIPES
    from fedflat.cli import main
    from fedflat.experiments.personal import PERSONAL_FILE, evaluate_run
    from conftest import BATCH_NORM_CNN

    model = BATCH_NORM_CNN if RECIPES[algo].personalization == "fedbn" else ()
    history = fedflat.run(tiny(f"algo={algo}", "rounds=2", *model), run_dir=tmp_path / "run", progress=False)
    parts = torch.load(tmp_path / "run" / PERSONAL_FILE, weights_only=True)
    sim = Simulation(tiny(f"algo={algo}", "rounds=2", *model))
    trained = sorted({c for t in range(2) for c in _sampled(sim, t)})
    assert parts["round"] == 2 and set(parts["state"]) == set(sim.algorithm.state_keys()) | ({"buffers"} if model
                                                                                               else set())
    private = sim.algorithm.parts["personalization"].private(sim.settings)
    for name, saved in parts["state"].items():  # the rows of exactly the clients that trained
        assert saved["clients"].tolist() == trained and saved["rows"].shape[0] == len(trained)
        if name != "buffers":  # FedPer's, FedBN's, FedRep's private entries only; Ditto's and APFL's whole models
            width = int(private.sum()) if private.any() else sim.num_parameters
            assert saved["rows"].shape[1] == width and ("entries" in saved) == bool(private.any())
    result = evaluate_run(tmp_path / "run")
    assert result["evaluation"] == "personalized" and result["round"] == 2
    assert result["accuracy"] == history.summary["final_test_acc"]
    assert result["loss"] == pytest.approx(history.summary["final_test_loss"], rel=1e-9)
    assert main(["evaluate", str(tmp_path / "run")]) == 0
    assert "(reproduced)" in capsys.readouterr().out
    plain = evaluate_run(tmp_path / "run", personalized=False)
    sim.server.w = history.final_parameters.to(sim.device)  # History's tensors are on the CPU
    sim.server.buffers = sim.model.vectors(history.state_dict)[1].to(sim.device)
    assert (plain["accuracy"], plain["loss"]) == sim.evaluate(sim.server.w) and plain["reported_accuracy"] is None
    assert plain["loss"] != result["loss"]


def test_a_run_without_personal_parts_saves_none_and_says_so(tiny, tmp_path):
    from fedflat.core import ConfigError
    from fedflat.experiments.personal import PERSONAL_FILE, evaluate_run

    fedflat.run(tiny("algo=fedavg", "rounds=1"), run_dir=tmp_path / "avg", progress=False)
    assert not (tmp_path / "avg" / PERSONAL_FILE).exists()
    with pytest.raises(ConfigError, match="keeps nothing on its clients; evaluate it without --personalized"):
        evaluate_run(tmp_path / "avg", personalized=True)
    fedflat.run(tiny("algo=fedper", "rounds=1"), run_dir=tmp_path / "per", progress=False)
    (tmp_path / "per" / PERSONAL_FILE).unlink()
    with pytest.raises(ConfigError, match="no personal.pt"):
        evaluate_run(tmp_path / "per")


def test_evaluate_on_a_sweep_folder_says_what_it_is_and_how_to_evaluate_one_of_its_runs(tmp_path, capsys):
    """`fedflat evaluate` on a sweep's folder said "no model file 'model.pt' (the run kept none yet)"."""
    import yaml

    from fedflat.cli import main
    from conftest import tiny_tree

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"config": tiny_tree(rounds=1), "grid": {"seed": [0, 1]},
                                     "out": str(tmp_path / "sw")}))
    assert main(["sweep", str(sweep), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err.strip()
    first = sorted(p for p in (tmp_path / "sw").iterdir() if p.is_dir())[0]
    assert err == (f"fedflat: {tmp_path / 'sw'} is a sweep folder, not one run's folder: evaluate one of its 2 runs, "
                   f"e.g. `fedflat evaluate {first}` (`fedflat report {tmp_path / 'sw'}` tabulates them all)")
    assert main(["evaluate", str(first)]) == 0 and "(reproduced)" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["evaluate", str(tmp_path / "empty")]) == 2
    assert "is not a run folder: it has no config.yaml and no run folder below it" in capsys.readouterr().err


@pytest.mark.slow  # check_part: six tiny runs each, 5-18 s on 2 busy cores
@pytest.mark.parametrize("part, recipe", [("Ditto", "ditto"), ("APFL", "apfl"), ("FedRepHead", "fedrep")])
def test_the_personalizations_keep_the_contract_and_resume_bit_for_bit(part, recipe):
    """fedflat.testing.check_part: no hook changes a tensor it does not own, the engines agree to float32 rounding,
    the part runs in FedSAM, and a run stopped after round R - 1 and resumed ends bit for bit where an
    uninterrupted one ends (the clients' personal models, and APFL's alpha_i, kept across the checkpoint)."""
    import fedflat.algorithms.apfl as apfl
    import fedflat.algorithms.ditto as ditto
    import fedflat.algorithms.fedrep as fedrep
    from fedflat.testing import check_part

    cls = {"Ditto": ditto.Ditto, "APFL": apfl.APFL, "FedRepHead": fedrep.FedRepHead}[part]
    report = check_part(cls, recipe=recipe)
    assert report["checkpoint"] == "resumed after round 2: bit for bit" and report["composed"].startswith("fedsam")
