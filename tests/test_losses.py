"""The clients' loss (train.loss, loss_fn) in every engine, the evaluation and the diagnostics, and the evaluation
metrics beyond accuracy (eval.metrics) checked against scikit-learn computed directly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import balanced_accuracy_score, f1_score, recall_score, roc_auc_score

import fedflat
from fedflat.core import ConfigError
from fedflat.engine.losses import focal_loss
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.metrics.objective import global_objective
from fedflat.testing import U32

UNEQUAL = ("rounds=2", "train.batch_size=7", "train.local_epochs=2")
ONE_CLIENT = ("data.num_clients=1", "sampling.clients_per_round=1", "train.batch_size=16", "train.local_epochs=1",
              "train.clip=null", "train.weight_decay=0", "rounds=2", "data.partition.min_size=1")
ALL_METRICS = "eval.metrics=[f1,balanced_accuracy,per_class_accuracy,auroc]"


def brier(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Brier's score per sample, ``sum_k (p_k - [y = k])^2``: a loss far from cross-entropy (its one-hot targets by
    comparison: ``F.one_hot`` cannot run under vmap)."""
    one_hot = (y[:, None] == torch.arange(logits.shape[-1], device=y.device)).to(logits)
    return (logits.softmax(-1) - one_hot).pow(2).sum(-1)


def test_a_custom_loss_trains_as_plain_sgd_on_it_by_hand(tiny):
    """One client, two rounds: fedflat's run with ``loss_fn=brier`` ends where SGD on Brier's mean over the same
    batches ends; its reported train and test losses are Brier's."""
    cfg = tiny(*ONE_CLIENT)
    run = fedflat.run(cfg, save=False, progress=False, loss_fn=brier)
    sim = Simulation(cfg)
    model, x, y = sim.model, sim.dataset.x_train, sim.dataset.y_train
    w = model.initial.clone()
    steps = 0
    for t in range(cfg.rounds):
        for idx in sim.batches.schedules(t, [0], [int(sim.server.new_context(t).steps[0])])[0]:
            leaf = w.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(brier(model.call_views(model.layout.views(leaf), sim.dataset.features(x[idx])),
                                             y[idx]).mean(), leaf)
            w = w - sim.server.lr_at(t) * g
            steps += 1
    # run.final_parameters is on the CPU, the hand computation on the run's device
    torch.testing.assert_close(run.final_parameters, w.cpu(), rtol=0, atol=16 * U32 * steps * w.abs().max().item())
    with torch.no_grad():
        test = brier(model(w, sim.dataset.features(sim.dataset.x_test)), sim.dataset.y_test).double().mean().item()
    assert run.metrics[-1]["test_loss"] == pytest.approx(test, rel=1e-5)
    plain = fedflat.run(cfg, save=False, progress=False)
    assert not torch.allclose(plain.final_parameters, run.final_parameters, atol=1e-4)


@pytest.mark.parametrize("loss", [{"loss_fn": brier}, {"overrides": ["train.loss=focal", "train.focal_gamma=1.5"]}])
def test_engines_agree_on_a_custom_loss(tiny, loss):
    """Padded, masked vectorized cohorts average the custom loss over each client's real samples as the sequential
    engine does (FedSAM: two passes per step)."""
    overrides = loss.get("overrides", [])
    runs = [fedflat.run(tiny(*UNEQUAL, "algo=fedsam", "algo.rho=0.05", *overrides, f"engine={e}"), save=False,
                        progress=False, loss_fn=loss.get("loss_fn")) for e in ("sequential", "vectorized")]
    torch.testing.assert_close(runs[1].final_parameters, runs[0].final_parameters, rtol=1e-4, atol=1e-5)
    assert runs[1].metrics[-1]["test_loss"] == pytest.approx(runs[0].metrics[-1]["test_loss"], rel=1e-4)


def test_cross_entropy_as_loss_fn_is_the_default_bit_for_bit(tiny):
    ce = fedflat.run(tiny(*UNEQUAL), save=False, progress=False,
                     loss_fn=lambda logits, y: F.cross_entropy(logits, y, reduction="none"))
    default = fedflat.run(tiny(*UNEQUAL), save=False, progress=False)
    assert torch.equal(ce.final_parameters, default.final_parameters)


def test_focal_loss_is_lin_et_al_and_gamma_zero_is_cross_entropy():
    logits, y = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]), torch.tensor([0, 2])
    p_t = logits.softmax(-1)[torch.arange(2), y]
    torch.testing.assert_close(focal_loss(logits, y, 2.0), -(1 - p_t) ** 2 * p_t.log())
    torch.testing.assert_close(focal_loss(logits, y, 0.0), F.cross_entropy(logits, y, reduction="none"))


def test_label_smoothing_reaches_the_evaluation_and_the_diagnostics(tiny):
    """``train.label_smoothing``: the test loss and the diagnostics' objective are F.cross_entropy's with it."""
    sim = Simulation(tiny("train.label_smoothing=0.2"))
    sim.run_round(0)
    acc, loss = sim.evaluate()
    with torch.no_grad():
        logits = sim.model(sim.server.w, sim.dataset.features(sim.dataset.x_test))
    assert loss == pytest.approx(F.cross_entropy(logits.double(), sim.dataset.y_test, label_smoothing=0.2).item(),
                                 rel=1e-5)
    objective = global_objective(sim, None)
    with torch.no_grad():
        train_logits = sim.model(sim.server.w, objective.x)
    assert objective.loss(sim.server.w) == pytest.approx(
        F.cross_entropy(train_logits, objective.y, label_smoothing=0.2).item(), rel=1e-5)


def test_a_loss_vmap_cannot_run_is_refused_by_the_vectorized_engine(tiny):
    def one_hot_brier(logits, y):
        return (logits.softmax(-1) - F.one_hot(y, logits.shape[-1]).to(logits)).pow(2).sum(-1)

    with pytest.raises(ConfigError, match="engine=vectorized: .*loss_fn"):
        Simulation(tiny("engine=vectorized"), UserInputs(loss_fn=one_hot_brier))


def test_a_loss_without_one_value_per_sample_is_a_clear_error(tiny):
    with pytest.raises(ConfigError, match="one loss per sample.*reduction='none'"):
        Simulation(tiny(), UserInputs(loss_fn=F.cross_entropy))
    with pytest.raises(ConfigError, match="loss_fn must be a function"):
        Simulation(tiny(), UserInputs(loss_fn="mse"))


def _sklearn_metrics(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    probs = logits.double().softmax(-1).cpu().numpy()
    pred, true = probs.argmax(1), y.cpu().numpy()
    out = {"f1": f1_score(true, pred, average="macro"), "balanced_acc": balanced_accuracy_score(true, pred),
           "auroc": roc_auc_score(true, probs, multi_class="ovr", average="macro")}
    out.update({f"acc_class_{k}": r for k, r in enumerate(recall_score(true, pred, average=None))})
    return out


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_evaluation_metrics_are_sklearns_on_the_test_predictions(tiny, engine):
    """F1, balanced and per-class accuracy and AUROC of the global model on the test set, as scikit-learn computes
    them from the same predictions; logged as test_<name> in each evaluated round's line and the summary."""
    cfg = tiny(ALL_METRICS, f"engine={engine}", "rounds=2")
    run = fedflat.run(cfg, save=False, progress=False)
    sim = Simulation(cfg)
    with torch.no_grad():
        logits = sim.model(run.final_parameters.to(sim.device), sim.dataset.features(sim.dataset.x_test))
    expected = _sklearn_metrics(logits, sim.dataset.y_test)
    line = run.metrics[-1]
    for name, value in expected.items():
        assert line[f"test_{name}"] == pytest.approx(value, rel=1e-6, abs=1e-6), name
        assert run.summary[f"final_test_{name}"] == line[f"test_{name}"]
    assert line["test_balanced_acc"] == pytest.approx(sum(expected[f"acc_class_{k}"] for k in range(3)) / 3)


def test_personalized_metrics_pool_every_clients_own_predictions(tiny):
    """FedPer: the metrics of the personalized evaluation are computed on every client's model's predictions on its
    own test share, pooled (as its accuracy is)."""
    sim = Simulation(tiny("algo=fedper", "eval.metrics=[f1,auroc]"))
    sim.run_round(0)
    acc, _ = sim.evaluate()
    personalization = sim.algorithm.parts["personalization"]
    logits, targets = [], []
    for client, share in enumerate(sim.client_tests):
        if not share.numel():
            continue
        state, known = sim.server.load_state(torch.tensor([client]), list(personalization.kept()))
        w = personalization.models(sim.server.w, state, known, sim.settings)[0]
        with torch.no_grad():
            logits.append(sim.model(w, sim.dataset.features(sim.dataset.x_test[share])))
        targets.append(sim.dataset.y_test[share])
    logits, targets = torch.cat(logits), torch.cat(targets)
    expected = _sklearn_metrics(logits, targets)
    assert acc == pytest.approx((logits.argmax(1) == targets).double().mean().item())
    assert sim.eval_metrics == pytest.approx({"f1": expected["f1"], "auroc": expected["auroc"]}, rel=1e-6, abs=1e-6)


def test_no_metrics_asked_logs_none(tiny):
    run = fedflat.run(tiny("rounds=1"), save=False, progress=False)
    assert not any(k.startswith("test_") and k not in ("test_acc", "test_loss") for k in run.metrics[-1])


def test_reports_show_the_metrics_mean_and_std_over_seeds(tiny, tmp_path):
    """``fedflat report``: a column per logged metric (not the per-class ones), mean and std over seeds in %."""
    from fedflat.experiments.report import report

    runs = [fedflat.run(tiny("rounds=1", f"seed={s}", "eval.metrics=[f1,per_class_accuracy]"),
                        run_dir=tmp_path / f"s{s}", progress=False) for s in (0, 1)]
    f1 = [100 * r.summary["final_test_f1"] for r in runs]
    mean = sum(f1) / 2
    std = abs(f1[0] - f1[1]) / 2 ** 0.5
    table = report([tmp_path])
    assert "final f1 (%)" in table and f"{mean:.2f} ± {std:.2f}" in table and "acc_class" not in table
    csv = report([tmp_path], fmt="csv")
    header, row = csv.splitlines()[:2]
    values = dict(zip(header.split(","), row.split(",")))
    assert float(values["final_f1_mean"]) == pytest.approx(mean, rel=1e-5)


def test_a_run_with_its_own_loss_resumes_from_python_with_it(tiny, tmp_path):
    """``config.yaml`` records ``train.loss: user:brier``; ``resume(..., config=, loss_fn=)`` continues the run on
    the same loss, ending bit for bit where an uninterrupted run ends; without them it says what to pass."""
    from fedflat.engine.checkpoint import CheckpointError
    from fedflat.experiments.resume import resume

    longer = fedflat.run(tiny("rounds=3", "threads=1"), save=False, progress=False, loss_fn=brier)
    cfg = tiny("rounds=2", "threads=1")
    fedflat.run(cfg, run_dir=tmp_path / "run", progress=False, loss_fn=brier)
    assert "loss: user:brier" in (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match="loss_fn="):
        resume(tmp_path / "run", progress=False)
    extended = resume(tmp_path / "run", config=cfg, overrides=["rounds=3"], loss_fn=brier, progress=False)
    assert torch.equal(extended.final_parameters, longer.final_parameters)
