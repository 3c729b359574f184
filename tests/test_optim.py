"""Local optimizers and schedules (fedflat/engine/optim.py): torch.optim's numbers on a tiny problem, the state's
lifetime, the engines' agreement, and the methods that need plain SGD refusing with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fedflat
from fedflat.core import ConfigError, LocalOptimizer
from fedflat.engine.optim import MOMENTUM_BUFFER, OptimizerState, round_lr
from fedflat.engine.simulation import Simulation
from fedflat.testing import U32

OPTIMIZERS = {  # fedflat's options -> the torch.optim it must reproduce (wd: the run's train.weight_decay)
    "sgd-momentum": (("train.momentum=0.9",), lambda p, lr, wd: torch.optim.SGD(p, lr, momentum=0.9, weight_decay=wd)),
    "sgd-nesterov": (("train.momentum=0.8", "train.nesterov=true"),
                     lambda p, lr, wd: torch.optim.SGD(p, lr, momentum=0.8, nesterov=True, weight_decay=wd)),
    "sgd-dampening": (("train.momentum=0.9", "train.dampening=0.3"),
                      lambda p, lr, wd: torch.optim.SGD(p, lr, momentum=0.9, dampening=0.3, weight_decay=wd)),
    "adam": (("train.optimizer=adam", "train.betas=[0.8,0.99]"),
             lambda p, lr, wd: torch.optim.Adam(p, lr, betas=(0.8, 0.99), weight_decay=wd)),
    "adamw": (("train.optimizer=adamw",), lambda p, lr, wd: torch.optim.AdamW(p, lr, weight_decay=wd)),
}
ONE_CLIENT = ("data.num_clients=1", "sampling.clients_per_round=1", "train.batch_size=16", "train.local_epochs=2",
              "train.clip=null", "train.weight_decay=0.01", "train.lr=0.05", "train.lr_decay=0.9", "rounds=3",
              "data.partition.min_size=1")


def _reference(sim: Simulation, make_optimizer, keep: str) -> torch.Tensor:
    """The one client's rounds with torch.optim on the module's own parameters, on the batches fedflat draws (its
    schedule per round), the optimizer built afresh every round (``keep=round``) or once (``keep=client``)."""
    model = sim.model  # the module's parameters as separate leaves, as torch.optim takes them
    params = [v.detach().clone().requires_grad_(True) for v in model.layout.views(model.initial)]
    x, y = sim.dataset.x_train, sim.dataset.y_train
    optimizer = None
    for t in range(sim.cfg.rounds):
        lr = sim.server.lr_at(t)
        if optimizer is None or keep == "round":
            optimizer = make_optimizer(params, lr, sim.cfg.train.weight_decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        steps = int(sim.server.new_context(t).steps[0])
        for idx in sim.batches.schedules(t, [0], [steps])[0]:
            optimizer.zero_grad()
            F.cross_entropy(model.call_views(params, sim.dataset.features(x[idx])), y[idx]).backward()
            optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in params]).cpu()  # beside run.final_parameters, on the CPU


@pytest.mark.parametrize("keep", ["round", "client"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_local_optimizer_matches_torch_optim(tiny, name, keep):
    """One client, three rounds of 2 epochs: fedflat's run ends where torch.optim on the same batches ends, with
    the state fresh every round or carried across the client's rounds."""
    options, make = OPTIMIZERS[name]
    cfg = tiny(*ONE_CLIENT, *options, f"train.optimizer_state={keep}")
    run = fedflat.run(cfg, save=False, progress=False)
    expected = _reference(Simulation(cfg), make, keep)
    steps = 3 * 2 * 4  # rounds x epochs x batches (<= 4 of 16 from 60 or fewer samples)
    # the flat views' backward and the module's differ at most in summation order: a few roundings per step
    tol = 16 * U32 * steps * expected.abs().max().item()
    torch.testing.assert_close(run.final_parameters, expected, rtol=0, atol=tol)
    if name == "adam" and keep == "round":  # (once) the optimizer does change the run
        plain = fedflat.run(tiny(*ONE_CLIENT), save=False, progress=False)
        assert (plain.final_parameters - expected).abs().max() > 100 * tol


def test_optimizer_step_rows_match_torch_optim():
    """Each row of a cohort's step is torch.optim's step of that row's own parameter (unit level, 5 steps)."""
    gen = torch.Generator().manual_seed(0)
    W0 = torch.randn(3, 7, generator=gen)
    ds = [torch.randn(3, 7, generator=gen) for _ in range(5)]
    for spec, make in ((LocalOptimizer("sgd", momentum=0.9, nesterov=True),
                        lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True)),
                       (LocalOptimizer("adam"), lambda p: torch.optim.Adam(p, 0.1)),
                       (LocalOptimizer("adamw"), lambda p: torch.optim.AdamW(p, 0.1, weight_decay=0.05))):
        state = OptimizerState.start(spec, W0, {}, {})
        W = W0.clone()
        for d in ds:
            W = state.step(W, d, 0.1, 0.05 if spec.name == "adamw" else 0.0, None)
        for row in range(3):
            p = W0[row].clone().requires_grad_(True)
            opt = make([p])
            for d in ds:
                p.grad = d[row].clone()
                opt.step()
            torch.testing.assert_close(W[row], p.detach(), rtol=8 * U32, atol=8 * U32)


def test_exhausted_rows_keep_their_parameters_and_state():
    """A row whose local steps are exhausted (inactive) keeps its parameters and its optimizer state."""
    W = torch.ones(2, 3)
    state = OptimizerState.start(LocalOptimizer("adam"), W, {}, {})
    d = torch.full((2, 3), 0.5)
    W1 = state.step(W, d, 0.1, 0.0, None)
    W2 = state.step(W1, d, 0.1, 0.0, torch.tensor([True, False]))
    assert torch.equal(W2[1], W1[1]) and not torch.equal(W2[0], W1[0])
    assert state.tensors["optim.step"].flatten().tolist() == [2.0, 1.0]


def test_schedules_match_torch_lr_schedulers(tiny):
    """``round_lr`` gives what torch's schedulers give epoch by epoch: exponential, step, and a linear warm-up into
    cosine annealing (``SequentialLR(LinearLR, CosineAnnealingLR)``)."""
    p = [torch.zeros(1, requires_grad=True)]

    def torch_lrs(make, rounds):
        opt = torch.optim.SGD(p, lr=0.1)
        scheduler = make(opt)
        out = []
        for _ in range(rounds):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
        return out

    lr_sched = torch.optim.lr_scheduler
    cases = {
        ("train.lr_decay=0.95",): lambda o: lr_sched.ExponentialLR(o, 0.95),
        ("train.schedule=step", "train.step_rounds=4", "train.step_gamma=0.5"): lambda o: lr_sched.StepLR(o, 4, 0.5),
        ("train.schedule=cosine", "train.warmup_rounds=3", "train.min_lr=0.01"): lambda o: lr_sched.SequentialLR(
            o, [lr_sched.LinearLR(o, 1 / 3, 1.0, total_iters=2), lr_sched.CosineAnnealingLR(o, 12 - 3, eta_min=0.01)],
            milestones=[3]),
    }
    for overrides, make in cases.items():
        cfg = tiny("rounds=12", "train.lr=0.1", *overrides)
        ours = [round_lr(cfg.train, t, cfg.rounds) for t in range(cfg.rounds)]
        assert ours == pytest.approx(torch_lrs(make, cfg.rounds), rel=1e-12, abs=1e-15), overrides


def test_default_schedule_is_the_old_exponential_decay_bit_for_bit(tiny):
    cfg = tiny("rounds=5", "train.lr=0.07", "train.lr_decay=0.99")
    assert [round_lr(cfg.train, t, 5) for t in range(5)] == [0.07 * 0.99 ** t for t in range(5)]


@pytest.mark.parametrize("options", [("train.momentum=0.9", "train.nesterov=true"), ("train.optimizer=adamw",)])
def test_engines_agree_with_a_local_optimizer(tiny, options):
    """Padded and masked vectorized cohorts step each client's optimizer exactly as the sequential engine does."""
    unequal = ("rounds=2", "train.batch_size=7", "train.local_epochs=2", "algo=fedsam", "algo.rho=0.05",
               "train.optimizer_state=client")
    runs = [fedflat.run(tiny(*unequal, *options, f"engine={e}"), save=False, progress=False)
            for e in ("sequential", "vectorized")]
    torch.testing.assert_close(runs[1].final_parameters, runs[0].final_parameters, rtol=1e-4, atol=1e-5)


def test_client_optimizer_state_is_client_state(tiny):
    """``optimizer_state=client`` keeps each trained client's momentum buffer in the client store (so it is
    checkpointed and travels to workers as the methods' state does); ``round`` keeps nothing."""
    kept = Simulation(tiny("train.momentum=0.9", "train.optimizer_state=client"))
    assert MOMENTUM_BUFFER in kept.server.client_state_keys
    kept.run_round(0)
    ids = kept.server.sample_clients(0)
    state, known = kept.server.load_state(ids)
    assert bool(known[MOMENTUM_BUFFER].all()) and state[MOMENTUM_BUFFER].abs().sum() > 0
    fresh = Simulation(tiny("train.momentum=0.9"))
    assert MOMENTUM_BUFFER not in fresh.server.client_state_keys


@pytest.mark.parametrize("algo, options, match", [
    ("scaffold", ("train.optimizer=adam",), "plain local SGD"),
    ("qfedavg", ("train.momentum=0.9",), "plain local SGD"),
    ("mofedsam", ("train.optimizer=adamw",), "plain local SGD"),
    ("fedwmsam", ("train.schedule=cosine",), "schedule=exponential"),
])
def test_methods_assuming_plain_sgd_refuse_other_optimizers(tiny, algo, options, match):
    with pytest.raises(ConfigError, match=match):
        Simulation(tiny(f"algo={algo}", *options))


def test_a_plugin_part_reading_pseudo_gradients_is_refused_under_another_optimizer(tiny):
    """``RoundContext.pseudo_gradients`` (``-Delta_i / (E_i eta_l)``) refuses to be read under momentum or Adam, so a
    user's part that divides by eta_l cannot silently compute a wrong quantity."""
    from fedflat.core import AlgorithmError

    sim = Simulation(tiny("train.momentum=0.5"))
    ctx = sim.server.new_context(0)
    ctx.uploads = {"model": ctx.w.expand(ctx.K, -1).clone()}
    with pytest.raises(AlgorithmError, match="only under plain SGD"):
        ctx.pseudo_gradients


@pytest.mark.parametrize("options, match", [
    (("train.nesterov=true",), "nesterov needs momentum"),
    (("train.optimizer=adam", "train.momentum=0.9"), "SGD's"),
    (("train.optimizer_state=client",), "plain SGD keeps no state"),
])
def test_bad_optimizer_options_are_one_line_errors(tiny, options, match):
    with pytest.raises(ConfigError, match=match):
        tiny(*options)


def test_kept_optimizer_state_is_checkpointed_and_resumed(tiny, tmp_path):
    """Adam's moments and step counts kept per client survive a checkpoint: 3 rounds then extended to 5 end bit for
    bit where 5 uninterrupted rounds end (a resume that lost them would restart each client's Adam)."""
    from fedflat.experiments.resume import resume

    options = ("train.optimizer=adam", "train.optimizer_state=client", "train.lr=0.01", "threads=1")
    longer = fedflat.run(tiny("rounds=5", *options), save=False, progress=False)
    fedflat.run(tiny("rounds=3", *options), run_dir=tmp_path / "run", progress=False)
    extended = resume(tmp_path / "run", overrides=["rounds=5"], progress=False)
    assert torch.equal(extended.final_parameters, longer.final_parameters)
    fresh = fedflat.run(tiny("rounds=5", *options[:1], *options[2:]), save=False, progress=False)
    assert not torch.equal(fresh.final_parameters, longer.final_parameters)  # the kept state matters


def test_a_cosine_run_is_not_extended_by_a_resume(tiny, tmp_path):
    """The cosine schedule spans the planned rounds: extending the run would change the rates of the rounds left."""
    from fedflat.experiments.resume import resume

    fedflat.run(tiny("rounds=2", "train.schedule=cosine"), run_dir=tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match="schedule=cosine anneals eta_l over the planned 2 rounds"):
        resume(tmp_path / "run", overrides=["rounds=4"], progress=False)
