"""The federated-SAM methods of issue 56 against hand computations, their reductions and compositions: FedASAM,
server-side SWA, FedSOL, FedSWA/FedMoSWA, FedMAN (docs/algorithms.md). Hand computations use full-batch local
steps, each gradient computed directly with autograd on the model (tests/test_sam_family.py's ``Hand``)."""
from __future__ import annotations

import copy
import sys
from collections import defaultdict
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_sam_family import FULL_BATCH, STEPS, Hand, _sampled, close, mix, rounds

import fedflat
from fedflat.algorithms import RECIPES, AlgorithmError, build_algorithm
from fedflat.engine.simulation import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # conformance.py's problem
sys.path.insert(0, str(Path(__file__).parent / "authors"))
import fedswa as code  # noqa: E402  (main_FedSWA.py, transcribed)


def run(cfg):
    return fedflat.run(cfg, save=False, progress=False)


# ---------------------------------------------------------------- FedASAM


def asam_eps(hand: Hand, w: torch.Tensor, i: int, rho: float, eta: float, mask: torch.Tensor | None):
    """Kwon et al.'s eq. 6: ``rho T^2 g / ||T g||``, ``T = |w| + eta`` where ``mask`` (1 elsewhere)."""
    g = hand.grad(w, i)
    T = w.abs() + eta
    if mask is not None:
        T = torch.where(mask, T, torch.ones_like(T))
    return rho * T * T * g / ((T * g).norm() + 1e-12)


@pytest.mark.parametrize("normalize", ["weights", "all"])
def test_fedasam_two_rounds_by_hand(tiny, normalize):
    rho, eta = 0.5, 0.05
    sim = Simulation(tiny(*FULL_BATCH, "algo=fedasam", f"algo.rho={rho}", f"algo.eta={eta}",
                          f"algo.normalize={normalize}"))
    hand = Hand(sim)
    layout = sim.settings.layout
    mask = torch.cat([torch.full((n,), "weight" in name, device=sim.server.w.device)
                      for name, n in zip(layout.names, layout.numels)])
    assert mask.any() and not mask.all(), "the model needs weights and biases for the test to tell them apart"
    w = sim.server.w.clone()
    for t in range(2):
        finals = [hand.local(w, i, sim.server.lr_at(t),
                             perturb=lambda k, wk, i=i: asam_eps(hand, wk, i, rho, eta,
                                                                 mask if normalize == "weights" else None))
                  for i in _sampled(sim, t)]
        w = torch.stack(finals).mean(0)
    rounds(sim)
    close(sim.server.w, w)


def test_fedasam_with_t_the_identity_is_fedsam(tiny):
    """``normalize=none`` (T = I) is FedSAM bit for bit; a huge eta (T = eta (1 + |w|/eta)) with rho / eta is FedSAM
    to the relative size of |w| / eta."""
    sam = run(tiny("algo=fedsam", "algo.rho=0.05", "rounds=2"))
    none = run(tiny("algo=fedasam", "algo.rho=0.05", "algo.normalize=none", "rounds=2"))
    assert torch.equal(none.final_parameters, sam.final_parameters)
    eta = 1e4
    large = run(tiny("algo=fedasam", f"algo.rho={0.05 / eta}", f"algo.eta={eta}", "algo.normalize=all", "rounds=2"))
    close(large.final_parameters, sam.final_parameters, rtol=1e-4, atol=1e-5)
    assert not torch.equal(run(tiny("algo=fedasam", "algo.rho=0.05", "rounds=2")).final_parameters,
                           sam.final_parameters)
    dp = run(tiny("algo=fedavg", "algo.perturbation=dpfedsam", "algo.rho=0.5", "rounds=2"))  # ASAM with T = |w|
    zero = run(tiny("algo=fedasam", "algo.rho=0.5", "algo.eta=0", "algo.normalize=all", "rounds=2"))
    close(zero.final_parameters, dp.final_parameters)


def test_fedasam_composes_runs_on_both_engines_and_is_listed(tiny):
    seq = run(tiny("algo=fedasam", "engine=sequential"))
    vec = run(tiny("algo=fedasam", "engine=vectorized"))
    close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    assert seq.summary["backprops_per_step"] == 2
    composed = run(tiny("algo=fedasam", "algo.correction=scaffold"))
    assert composed.summary["algorithm"] == "fedasam[correction=scaffold]"
    assert "Caldarola" in RECIPES["fedasam"].source and "debcaldarola/fedsam" in RECIPES["fedasam"].source


# ---------------------------------------------------------------- conformance with the authors' code

class ASAM:
    """Transcribed unmodified from github.com/debcaldarola/fedsam (models/clients/minimizers.py, commit 64bbf93),
    the authors' FedASAM minimizer."""

    def __init__(self, optimizer, model, rho=0.5, eta=0.01):
        self.optimizer = optimizer
        self.model = model
        self.rho = rho
        self.eta = eta
        self.state = defaultdict(dict)

    @torch.no_grad()
    def ascent_step(self):
        wgrads = []
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            t_w = self.state[p].get("eps")
            if t_w is None:
                t_w = torch.clone(p).detach()
                self.state[p]["eps"] = t_w
            if 'weight' in n:
                t_w[...] = p[...]
                t_w.abs_().add_(self.eta)
                p.grad.mul_(t_w)
            wgrads.append(torch.norm(p.grad, p=2))
        wgrad_norm = torch.norm(torch.stack(wgrads), p=2) + 1.e-16
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            t_w = self.state[p].get("eps")
            if 'weight' in n:
                p.grad.mul_(t_w)
            eps = t_w
            eps[...] = p.grad[...]
            eps.mul_(self.rho / wgrad_norm)
            p.add_(eps)
        self.optimizer.zero_grad()

    @torch.no_grad()
    def descent_step(self):
        for n, p in self.model.named_parameters():
            if p.grad is None:
                continue
            p.sub_(self.state[p]["eps"])
        self.optimizer.step()
        self.optimizer.zero_grad()


def authors_fedasam(x, y, model_fn, rho, eta) -> list[torch.Tensor]:
    """The authors' FedASAM on scripts/conformance.py's problem: each client's ``run_epoch`` (models/clients/
    asam_client.py: ascent on the batch's loss, descent on the perturbed loss, ``optim.SGD`` with weight decay, no
    clip) over full-batch steps, the server's average weighted by the clients' samples (models/servers/
    fedavg_server.py:121-150, ``update_model``)."""
    from conformance import LR, LR_DECAY, STEPS, WD, code_rounds, sample_weights

    def run_epoch(client, server, xi, yi, t):
        optimizer = torch.optim.SGD(client.parameters(), lr=LR * LR_DECAY ** t, weight_decay=WD)
        minimizer = ASAM(optimizer, client, rho, eta)
        for _ in range(STEPS):
            torch.nn.functional.cross_entropy(client(xi), yi).backward()
            minimizer.ascent_step()
            torch.nn.functional.cross_entropy(client(xi), yi).backward()
            minimizer.descent_step()
    return code_rounds(x, y, model_fn, run_epoch, sample_weights())


def test_fedasam_equals_the_authors_code_on_the_conformance_problem():
    """Three rounds of the authors' minimizer (transcribed) and of fedflat's ``fedasam`` (its default
    ``normalize=weights``) with the code's sample weights on scripts/conformance.py's problem of unequal clients:
    the global models agree to float32 rounding (entries of order 0.16; the codes' norm guards 1e-16 and 1e-12
    differ below it). Uniform weights, or T on the biases too, do not."""
    from conformance import fedflat_run, problem

    x, y, model_fn = problem()
    rho, eta = 0.5, 0.2
    theirs = authors_fedasam(x, y, model_fn, rho, eta)
    options = ["algo=fedasam", f"algo.rho={rho}", f"algo.eta={eta}"]
    ours = fedflat_run([*options, "algo.weighting=samples"], x, y, model_fn, None, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)
    uniform = fedflat_run(options, x, y, model_fn, None, "loss")
    assert (uniform[-1] - theirs[-1]).abs().max() > 1e-4  # the clients' weights matter on this problem
    everything = fedflat_run([*options, "algo.weighting=samples", "algo.normalize=all"], x, y, model_fn, None, "loss")
    assert (everything[-1] - theirs[-1]).abs().max() > 1e-5  # the biases' T tells the options apart


# ---------------------------------------------------------------- server-side SWA


def swa_by_hand(hand: Hand, sim: Simulation, rounds_: int, s: int, c: int, swa_lr: float, rule: str):
    """The global model after each round: FedAvg's iterate x trained with the cyclic rate from round s, and the
    running mean of the collected iterates (swa.py's docstring, written out)."""
    x, w_swa, n, out = sim.server.w.clone(), None, 0, []
    for t in range(rounds_):
        lr = sim.server.lr_at(t)
        if t >= s and c > 1:
            tau = (((t if rule == "code" else t - s) % c) + 1) / c
            lr = (1 - tau) * lr + tau * swa_lr
        x_new = torch.stack([hand.local(x, i, lr) for i in _sampled(sim, t)]).mean(0)
        if t == s:
            w_swa, n = x.clone(), (0 if rule == "code" else 1)
        collect = (t > s and (t - s) % c == 0) if rule == "code" else (t >= s and (t - s + 1) % c == 0)
        if collect:
            w_swa, n = (n * w_swa + x_new) / (n + 1), n + 1
        x = x_new
        out.append(x.clone() if t < s else w_swa.clone())
    return out


@pytest.mark.parametrize("rule", ["code", "izmailov"])
def test_swa_five_rounds_by_hand(tiny, rule):
    s, c, swa_lr = 1, 2, 0.01
    sim = Simulation(tiny(*FULL_BATCH, "algo=fedavg-swa", f"algo.start_round={s}", f"algo.cycle={c}",
                          f"algo.swa_lr={swa_lr}", f"algo.rule={rule}", "rounds=5"))
    expected = swa_by_hand(Hand(sim), sim, 5, s, c, swa_lr, rule)
    for t in range(5):
        sim.run_round(t)
        close(sim.server.w, expected[t])
    assert int(sim.server.state["swa.n"]) == (1 if rule == "code" else 3)  # collected after 3; after 2 and 4


def test_swa_before_its_start_is_its_base_method_and_starts_at_three_quarters(tiny):
    """Before round s the run is FedSAM bit for bit (never started: the whole run); ``start`` 0.75 of 4 rounds is
    round 3, so rounds 0-2 are FedSAM's and round 3's model is the frozen x^3 of the code's rule."""
    sam = run(tiny("algo=fedsam", "algo.rho=0.05", "rounds=4"))
    never = run(tiny("algo=fedsam-swa", "algo.rho=0.05", "rounds=4", "algo.start_round=4", "algo.cycle=3"))
    assert torch.equal(never.final_parameters, sam.final_parameters)
    base = Simulation(tiny("algo=fedsam", "algo.rho=0.05", "rounds=4"))
    swa = Simulation(tiny("algo=fedsam-swa", "algo.rho=0.05", "rounds=4"))
    for t in range(3):
        base.run_round(t)
        swa.run_round(t)
        assert torch.equal(swa.server.w, base.server.w)
    x3 = swa.server.w.clone()
    base.run_round(3)
    swa.run_round(3)
    assert torch.equal(swa.server.w, x3) and torch.equal(swa.server.state["swa.x"], base.server.w)
    assert run(tiny("algo=fedasam-swa", "rounds=4")).summary["algorithm"] == "fedasam-swa"


def test_swa_composes_runs_on_both_engines_and_resumes(tiny):
    options = ("algo=fedsam", "algo.server=swa", "algo.start_round=1", "algo.cycle=2", "rounds=4")
    seq = run(tiny(*options, "engine=sequential"))
    vec = run(tiny(*options, "engine=vectorized"))
    close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    assert seq.summary["algorithm"] == "fedsam[server=swa]"
    cfg = tiny("algo=fedavg-swa", "algo.start_round=1", "algo.cycle=2", "rounds=4")
    whole = Simulation(cfg)
    rounds(whole, 4)
    first = Simulation(cfg)
    rounds(first, 2)
    second = Simulation(cfg)
    second.server.load_state_dict(first.server.state_dict())
    second.run_round(2)
    second.run_round(3)
    assert torch.equal(second.server.w, whole.server.w)


def schedule_cycling_lr(round, c, lr1, lr2):
    """Transcribed unmodified from github.com/debcaldarola/fedsam (models/utils/main_utils.py:97, commit 64bbf93)."""
    t = 1 / c * (round % c + 1)
    lr = (1 - t) * lr1 + t * lr2
    return lr


class SWAServerOfTheCode:
    """The authors' server-side SWA methods (models/servers/fedavg_server.py:160-168, commit 64bbf93), transcribed
    unmodified, on a server holding ``client_model`` (the FedAvg model) and ``swa_model``."""

    def __init__(self, client_model):
        self.client_model = client_model
        self.swa_model = None

    def setup_swa_model(self, swa_ckpt=None):
        self.swa_model = copy.deepcopy(self.client_model)
        if swa_ckpt is not None:
            self.swa_model.load_state_dict(swa_ckpt)

    def update_swa_model(self, alpha):
        for param1, param2 in zip(self.swa_model.parameters(), self.client_model.parameters()):
            param1.data *= (1.0 - alpha)
            param1.data += param2.data * alpha


def test_swa_equals_the_authors_code_on_the_conformance_problem(monkeypatch):
    """The authors' round loop (models/main.py:137-180: setup at s, the cyclic rate, a collection after rounds t > s
    with mod(t - s, c) = 0), their SWA methods and schedule transcribed, FedAvg's clients as plain SGD (their
    ``Client.run_epoch``) averaged by their samples (``update_model``), against ``fedavg-swa`` with sample weights on
    scripts/conformance.py's problem of unequal clients, 6 rounds without lr decay (the code's cycle starts from the
    base rate): the evaluated models agree to float32 rounding."""
    import conformance
    from conformance import LR, STEPS, WD, fedflat_run, problem, sample_weights, shares

    num_rounds, swa_start, swa_c, swa_lr = 6, 2, 2, 0.01
    x, y, model_fn = problem()
    server = SWAServerOfTheCode(model_fn())
    theirs = []
    swa_n = 0
    for i in range(num_rounds):
        lr = LR
        if i >= swa_start:
            if i == swa_start:
                server.setup_swa_model()
            if swa_c > 1:
                lr = schedule_cycling_lr(i, swa_c, LR, swa_lr)
        finals = []
        for xi, yi in shares(x, y):
            client = model_fn()
            client.load_state_dict(server.client_model.state_dict())
            optimizer = torch.optim.SGD(client.parameters(), lr=lr, weight_decay=WD)
            for _ in range(STEPS):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(client(xi), yi).backward()
                optimizer.step()
            finals.append(torch.nn.utils.parameters_to_vector(client.parameters()).detach())
        torch.nn.utils.vector_to_parameters((sample_weights()[:, None] * torch.stack(finals)).sum(0),
                                            server.client_model.parameters())
        if i > swa_start and (i - swa_start) % swa_c == 0:
            server.update_swa_model(1.0 / (swa_n + 1))
            swa_n += 1
        evaluated = server.client_model if server.swa_model is None else server.swa_model
        theirs.append(torch.nn.utils.parameters_to_vector(evaluated.parameters()).detach().clone())
    monkeypatch.setattr(conformance, "ROUNDS", num_rounds)
    ours = fedflat_run(["algo=fedavg-swa", f"algo.start_round={swa_start}", f"algo.cycle={swa_c}",
                        f"algo.swa_lr={swa_lr}", "train.lr_decay=1.0", "algo.weighting=samples"], x, y, model_fn,
                       None, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-7)
    assert swa_n == 1


# ---------------------------------------------------------------- FedSOL


def kl_grad(hand: Hand, w: torch.Tensor, w_g: torch.Tensor, i: int, tau: float = 3.0) -> torch.Tensor:
    """``grad_w KLDivLoss(batchmean)(log softmax(f(w)/tau), softmax(f(w_g)/tau))`` on client ``i``'s data."""
    idx = hand.sim.client_indices[i]
    x = hand.sim.dataset.x_train[idx]
    leaf = w.detach().clone().requires_grad_(True)
    with torch.no_grad():
        target = torch.softmax(hand.sim.model(w_g, x) / tau, dim=1)
    kl = torch.nn.KLDivLoss(reduction="batchmean")(torch.log_softmax(hand.sim.model(leaf, x) / tau, dim=1), target)
    (g,) = torch.autograd.grad(kl, leaf)
    return g


@pytest.mark.parametrize("strength", ["adaptive", "fixed"])
def test_fedsol_two_rounds_by_hand(tiny, strength):
    rho = 0.5
    sim = Simulation(tiny(*FULL_BATCH, "algo=fedsol", f"algo.rho={rho}", f"algo.strength={strength}"))
    hand, layout = Hand(sim), sim.settings.layout

    def eps(k, wk, w_g, i):
        if k == 0:
            return None  # w = w_g: grad KL = 0
        e = rho * hand.unit(kl_grad(hand, wk, w_g, i))
        if strength == "fixed":
            return e
        s = torch.cat([torch.nn.functional.normalize(v, p=2, dim=0).reshape(-1)
                       for v in layout.views((wk - w_g).abs())])
        return s * e

    w = sim.server.w.clone()
    for t in range(2):
        finals = [hand.local(w, i, sim.server.lr_at(t), perturb=lambda k, wk, i=i, w_g=w: eps(k, wk, w_g, i))
                  for i in _sampled(sim, t)]
        w = torch.stack(finals).mean(0)
    rounds(sim)
    close(sim.server.w, w)


def test_fedsol_reductions(tiny):
    """rho 0 is FedAvg bit for bit; so is one local step (w = w_g: grad KL = 0, eps = 0), either strength."""
    avg = run(tiny("algo=fedavg", "rounds=2"))
    assert torch.equal(run(tiny("algo=fedsol", "algo.rho=0", "rounds=2")).final_parameters, avg.final_parameters)
    one = ("rounds=2", "train.local_steps=1")
    for strength in ("adaptive", "fixed"):
        assert torch.equal(run(tiny("algo=fedsol", f"algo.strength={strength}", *one)).final_parameters,
                           run(tiny("algo=fedavg", *one)).final_parameters)
    assert not torch.equal(run(tiny("algo=fedsol", "rounds=2")).final_parameters, avg.final_parameters)


def test_fedsol_composes_runs_on_both_engines_and_is_refused_under_dp_sgd(tiny):
    seq = run(tiny("algo=fedsol", "engine=sequential"))
    vec = run(tiny("algo=fedsol", "engine=vectorized"))
    close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    assert seq.summary["backprops_per_step"] == 2
    composed = run(tiny("algo=fedsol", "algo.correction=scaffold"))
    assert composed.summary["algorithm"] == "fedsol[correction=scaffold]"
    with pytest.raises(Exception, match="perturbation 'sol': its perturbation is the gradient of a distillation"):
        run(tiny("algo=fedsol", "privacy.level=instance", "privacy.clip=0.8", "privacy.noise_multiplier=1.2"))
    client_dp = run(tiny("algo=fedsol", "privacy.clip=0.8", "privacy.noise_multiplier=1.2", "rounds=2"))
    assert client_dp.summary["status"] == "completed"


class ExpSAM(torch.optim.Optimizer):
    """Transcribed unmodified from github.com/Lee-Gihun/FedSOL (algorithms/fedsol_adaptive/ClientTrainer.py, commit
    ebc3f64), the authors' adaptive FedSOL optimizer."""

    def __init__(
        self, params, ref_params, base_optimizer, rho=0.05, adaptive=False, **kwargs
    ):
        # assert rho >= 0.0, f"Invalid rho, should be non-negative: {rho}"

        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super(ExpSAM, self).__init__(params, defaults)

        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

        self.ref_param_groups = []
        ref_param_groups = list(ref_params)

        if not isinstance(ref_param_groups[0], dict):
            ref_param_groups = [{"params": ref_param_groups}]

        for ref_param_group in ref_param_groups:
            self.add_ref_param_group(ref_param_group)

        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group, ref_group in zip(self.param_groups, self.ref_param_groups):
            scale = group["rho"] / (grad_norm + 1e-12)

            for p, ref_p in zip(group["params"], ref_group["params"]):
                if p.grad is None:
                    try:
                        self.state[p]["old_p"] = p.data.clone()
                    except:  # noqa: E722
                        pass

                    continue

                # avg_mag = torch.abs(p - ref_p).mean()

                self.state[p]["old_p"] = p.data.clone()
                e_w = F.normalize((p - ref_p).abs(), 2, dim=0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"

        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"

        self.base_optimizer.step()  # do the actual "sharpness-aware" update

        if zero_grad:
            self.zero_grad()

    def _grad_norm(self):
        shared_device = self.param_groups[0]["params"][
            0
        ].device  # put everything on the same device, in case of model parallelism
        norm = torch.norm(
            torch.stack(
                [
                    (1.0 * p.grad).norm(p=2).to(shared_device)
                    for group, ref_group in zip(
                        self.param_groups, self.ref_param_groups
                    )
                    for p, ref_p in zip(group["params"], ref_group["params"])
                    if p.grad is not None
                ]
            ),
            p=2,
        )
        return norm

    def add_ref_param_group(self, param_group):
        params = param_group["params"]

        if isinstance(params, torch.Tensor):
            param_group["params"] = [params]
        else:
            param_group["params"] = list(params)

        for name, default in self.defaults.items():
            param_group.setdefault(name, default)

        params = param_group["params"]

        param_set = set()
        for group in self.ref_param_groups:
            param_set.update(set(group["params"]))

        if not param_set.isdisjoint(set(param_group["params"])):
            raise ValueError("some parameters appear in more than one parameter group")

        self.ref_param_groups.append(param_group)


def authors_fedsol(x, y, model_fn, rho, momentum) -> list[torch.Tensor]:
    """The authors' adaptive FedSOL client (``ClientTrainer.train``: the KL pass at temperature 3, ``first_step``,
    the cross-entropy pass, ``second_step``; the BatchNorm switches and head/body freezing, no-ops for this model
    with ``perturb_head = perturb_body = true``, left out) on scripts/conformance.py's problem, averaged by the
    clients' samples (``BaseServer._aggregation``, algorithms/BaseServer.py:164-176)."""
    from conformance import LR, LR_DECAY, STEPS, WD, code_rounds, sample_weights

    KLDiv, criterion = torch.nn.KLDivLoss(reduction="batchmean"), torch.nn.CrossEntropyLoss()

    def train(model, server, data, targets, t):
        dg_model = copy.deepcopy(server)
        for q in dg_model.parameters():
            q.requires_grad = False
        sam_optimizer = ExpSAM(model.parameters(), dg_model.parameters(), base_optimizer=torch.optim.SGD,
                               rho=rho, adaptive=False, lr=LR * LR_DECAY ** t, momentum=momentum,
                               weight_decay=WD)
        for _ in range(STEPS):
            logits = model(data)
            with torch.no_grad():
                dg_probs = torch.softmax(dg_model(data) / 3, dim=1)
            KLDiv(F.log_softmax(logits / 3, dim=1), dg_probs).backward()
            sam_optimizer.first_step(zero_grad=True)
            criterion(model(data), targets).backward()
            sam_optimizer.second_step(zero_grad=True)
    return code_rounds(x, y, model_fn, train, sample_weights())


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fedsol_equals_the_authors_code_on_the_conformance_problem(momentum):
    """Three rounds of the authors' adaptive FedSOL (``ExpSAM`` transcribed) and fedflat's ``fedsol`` on
    scripts/conformance.py's problem of unequal clients with the code's sample weights, plain SGD and SGD with
    momentum 0.9 fresh each round (the code builds its optimizer each round): equal to float32 rounding."""
    from conformance import fedflat_run, problem

    x, y, model_fn = problem()
    theirs = authors_fedsol(x, y, model_fn, 1.0, momentum)
    options = ["algo=fedsol", "algo.rho=1.0", "algo.weighting=samples"] + (
        [f"train.momentum={momentum}"] if momentum else [])
    ours = fedflat_run(options, x, y, model_fn, None, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)


# ---------------------------------------------------------------- FedSWA, FedMoSWA


def swa_factor(k: int, E: int, rho: float, scale: float) -> float:
    return scale * ((1 - k / E) + rho * k / E)


def test_fedswa_two_rounds_by_hand(tiny):
    rho, scale = 0.2, 2.0
    sim = Simulation(tiny(*FULL_BATCH, "algo=fedswa", f"algo.rho={rho}", f"algo.scale={scale}"))
    hand = Hand(sim)
    w = sim.server.w.clone()
    for t in range(2):
        finals = [hand.local(w, i, sim.server.lr_at(t), direction=lambda k, wk, g: swa_factor(k, STEPS, rho, scale) * g)
                  for i in _sampled(sim, t)]
        w = torch.stack(finals).mean(0)
    rounds(sim)
    close(sim.server.w, w)


def test_fedmoswa_three_rounds_by_hand(tiny):
    rho, gamma = 0.1, 0.4
    sim = Simulation(tiny(*FULL_BATCH, "algo=fedmoswa", f"algo.rho={rho}", f"algo.gamma={gamma}", "rounds=3"))
    hand = Hand(sim)
    w, c, c_i = sim.server.w.clone(), torch.zeros_like(sim.server.w), {}
    for t in range(3):
        lr, finals, gaps = sim.server.lr_at(t), [], []
        for i in _sampled(sim, t):
            ci = c_i.get(i, torch.zeros_like(w))
            wf = hand.local(w, i, lr, direction=lambda k, wk, g, ci=ci: swa_factor(k, STEPS, rho, 1.0) * (g + c - ci))
            c_i[i] = ci - c + (w - wf) / (STEPS * lr * (1 + rho) / 2)
            gaps.append(c_i[i] - c)
            finals.append(wf)
        c = c + (1.0 if t == 0 else gamma) * torch.stack(gaps).mean(0)
        w = torch.stack(finals).mean(0)
    assert set(_sampled(sim, 1)) & (set(_sampled(sim, 0)) | set(_sampled(sim, 2))), "the test needs a returning client"
    rounds(sim, 3)
    close(sim.server.w, w)
    close(sim.server.state["moswa.c"], c)


def test_fedswa_without_decay_is_fedavg_and_plain_sgd_is_required(tiny):
    """rho 1, scale 1 (a constant rate) is FedAvg, to the rounding of w - (eta 1) d against w - eta d; the schedule
    scales plain SGD's rate, so another local optimizer is refused, saying why."""
    close(run(tiny("algo=fedswa", "algo.rho=1", "rounds=2")).final_parameters,
          run(tiny("algo=fedavg", "rounds=2")).final_parameters, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(run(tiny("algo=fedswa", "rounds=2")).final_parameters,
                              run(tiny("algo=fedavg", "rounds=2")).final_parameters)
    with pytest.raises(Exception, match=r"needs plain local SGD steps \(correction 'swa': its within-round schedule"):
        run(tiny("algo=fedswa", "train.momentum=0.9"))


def test_fedswa_and_fedmoswa_compose_and_agree_across_engines(tiny):
    for algo in ("fedswa", "fedmoswa"):
        seq = run(tiny(f"algo={algo}", "algo.rho=0.1", "engine=sequential"))
        vec = run(tiny(f"algo={algo}", "algo.rho=0.1", "engine=vectorized"))
        close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    composed = run(tiny("algo=fedswa", "algo.perturbation=sam", "algo.perturbation.rho=0.1"))
    assert composed.summary["algorithm"] == "fedswa[perturbation=sam]"
    with pytest.raises(AlgorithmError, match="each have a 'rho'"):
        build_algorithm({"name": "fedswa", "perturbation": "sam", "rho": 0.1})


class AuthorsWorker(code.DataWorker):
    """The worker of main_FedSWA.py (its client updates in tests/authors/fedswa.py), with the data loader of one full
    batch per epoch (their ``get_data_loader`` reads CIFAR)."""

    def __init__(self, model, x, y):
        self.model, self.x, self.y = model, x, y
        self.criterion = torch.nn.CrossEntropyLoss()
        self.ci = {}
        self.loss = 0

    def data_id_loader(self, index):
        self.data_iterator = [(self.x, self.y)]


class WeightsModel(torch.nn.Sequential):
    """The conformance MLP with the codes' ``get_weights``/``set_weights`` (their model.py:566-570)."""

    def get_weights(self):
        return {k: v.cpu() for k, v in self.state_dict().items()}

    def set_weights(self, weights):
        self.load_state_dict(weights)


@pytest.mark.parametrize("method", ["FedSWA", "FedMoSWA"])
def test_fedswa_and_fedmoswa_equal_the_authors_code_on_the_conformance_problem(method):
    """Three rounds of the code's ``update_FedSWA`` (averaged as ``apply_weights_avg``) and ``update_FedMoSWA``
    (``apply_weights_SCAF``'s MoFedSWA branch) on scripts/conformance.py's problem against ``fedswa algo.scale=2``
    and ``fedmoswa`` with the code's weight decay 1e-3 and clip 10: equal to float32 rounding. Each client has its
    own worker (the code's workers serve clients in turn and carry ``self.ci`` over to one seen for the first time)."""
    from conformance import CLIENTS, LR, LR_DECAY, ROUNDS, STEPS, fedflat_run, problem, shares

    code.c_dict.clear()
    code.alg, code.selection = "MoFedSWA", 1.0
    x, y, model_fn = problem()

    def fresh():
        model = WeightsModel(*model_fn())
        return model

    server = fresh()
    workers = [AuthorsWorker(fresh(), xi, yi) for xi, yi in shares(x, y)]
    ps_c, theirs = {}, []
    for t in range(ROUNDS):
        weights = {k: v.clone() for k, v in server.state_dict().items()}
        lr = LR * LR_DECAY ** t
        if method == "FedSWA":
            deltas = [w.update_FedSWA(weights, STEPS, i, lr) for i, w in enumerate(workers)]
            server.load_state_dict({k: weights[k] + sum(d[k] for d in deltas) / CLIENTS for k in weights})
        else:
            pairs = [w.update_FedMoSWA(weights, STEPS, i, ps_c, lr) for i, w in enumerate(workers)]
            _, ps_c = code.apply_weights_SCAF(CLIENTS, pairs, server, ps_c)
        theirs.append(torch.nn.utils.parameters_to_vector(server.parameters()).detach().clone())
    options = (["algo=fedswa", "algo.scale=2"] if method == "FedSWA" else ["algo=fedmoswa"])
    ours = fedflat_run(options + ["train.weight_decay=0.001"], x, y, model_fn, 10.0, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)


# ---------------------------------------------------------------- FedMAN


def man_grad(hand: Hand, w: torch.Tensor, i: int, mu: float) -> torch.Tensor:
    """The gradient of ``CE + mu/2 mean_b mean_j relu(x W1^T + b1)_j^2`` of the tiny MLP (Linear-ReLU-Linear),
    written out by hand from the layout (no hooks)."""
    idx = hand.sim.client_indices[i]
    x, y = hand.sim.dataset.x_train[idx].reshape(len(idx), -1), hand.sim.dataset.y_train[idx]
    leaf = w.detach().clone().requires_grad_(True)
    W1, b1, W2, b2 = hand.sim.settings.layout.views(leaf)
    h = torch.relu(x @ W1.T + b1)
    loss = F.cross_entropy(h @ W2.T + b2, y) + mu / 2 * h.pow(2).mean(1).mean()
    (g,) = torch.autograd.grad(loss, leaf)
    return g


@pytest.mark.parametrize("algo", ["fedavg-man", "fedsam-man"])
def test_fedman_two_rounds_by_hand(tiny, algo):
    """The penalty in every gradient of the local objective: FedAvg's, and under SAM both the ascent's and the
    perturbed one (as the authors' man_code_sam)."""
    mu, rho = 0.5, 0.1
    sim = Simulation(tiny(*FULL_BATCH, f"algo={algo}", f"algo.mu={mu}", *([f"algo.rho={rho}"] if "sam" in algo else [])))
    hand = Hand(sim)
    assert [n.split(".")[-1] for n in sim.settings.layout.names] == ["weight", "bias", "weight", "bias"]
    hand.grad = lambda w, i: man_grad(hand, w, i, mu)  # the local objective's gradient, penalty included
    sam = (lambda k, wk, i: hand.sam_eps(wk, i, rho)) if "sam" in algo else (lambda k, wk, i: None)
    w = sim.server.w.clone()
    for t in range(2):
        lr = sim.server.lr_at(t)
        finals = [hand.local(w, i, lr, perturb=lambda k, wk, i=i: sam(k, wk, i)) for i in _sampled(sim, t)]
        w = torch.stack(finals).mean(0)
    rounds(sim)
    close(sim.server.w, w)


def test_fedman_with_zero_weight_is_its_base_and_stacks_on_any_method(tiny):
    for base, options in (("fedavg", ()), ("fedsam", ("algo.rho=0.05",)), ("feddyn", ())):
        plain = run(tiny(f"algo={base}", *options, "rounds=2"))
        zero = run(tiny(f"algo={base}", "algo.filter=man", "algo.mu=0", *options, "rounds=2"))
        assert torch.equal(zero.final_parameters, plain.final_parameters), base
        penalized = run(tiny(f"algo={base}", "algo.filter=man", *options, "rounds=2"))
        assert not torch.equal(penalized.final_parameters, plain.final_parameters), base
        assert penalized.summary["algorithm"] == f"{base}[filter=man]"
    seq = run(tiny("algo=fedsam-man", "engine=sequential", "train.batch_size=7"))  # padded batches in vectorized
    vec = run(tiny("algo=fedsam-man", "engine=vectorized", "train.batch_size=7"))
    close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="filter 'man': its activation penalty enters the gradients outside DP-SGD"):
        run(tiny("algo=fedavg-man", "privacy.level=instance", "privacy.clip=0.8", "privacy.noise_multiplier=1.2"))


class AuthorsMLP(torch.nn.Module):
    """scripts/conformance.py's 8-6-3 tanh MLP returning ``(logits, var_list, None)`` as the authors' models do
    (``code/utils_models.py``: ``act = torch.mean(x**2, axis=[1])`` after each hidden nonlinearity)."""

    def __init__(self, sequential):
        super().__init__()
        self.fc1, self.fc2 = sequential[0], sequential[2]

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        act1 = torch.mean(x**2,axis = [1])
        var_list = [act1]
        return self.fc2(x), var_list, None


def test_fedman_equals_the_authors_code_on_the_conformance_problem():
    """The authors' FedAvg+MAN client step (``code/utils_general.py``, ``train_fedavgreg_mdl`` l.459-474: the
    summed cross-entropy over the batch size, ``loss_var_algo`` the sum over layers of the batch means, ``loss =
    loss_f_i + (mu_mean/2) loss_var_algo``, the clip 10, ``optim.SGD`` with weight decay), transcribed, over full-batch
    steps on scripts/conformance.py's problem of unequal clients, averaged by their samples as ``train_FedAvgReg``
    (``code/utils_methods.py``, its ``weight_list``), against ``fedavg-man`` with sample weights: equal to float32
    rounding."""
    from conformance import LR, LR_DECAY, STEPS, WD, code_rounds, fedflat_run, problem, sample_weights

    mu_mean, max_norm = 0.4, 10.0
    x, y, model_fn = problem()

    def train(sequential, server, batch_x, batch_y, t):
        model = AuthorsMLP(sequential)  # its layers: training it trains the client's model
        loss_fn = torch.nn.CrossEntropyLoss(reduction='sum')
        optimizer = torch.optim.SGD(model.parameters(), lr=LR * LR_DECAY ** t, weight_decay=WD)
        for _ in range(STEPS):
            y_pred,tmp_var_,tmp_mean_ = model(batch_x)

            loss_f_i = loss_fn(y_pred, batch_y.reshape(-1).long())
            loss_f_i = loss_f_i / list(batch_y.size())[0]

            loss_var_algo = 0.0

            num_layers = len(tmp_var_)  # noqa: F841
            for var_val in tmp_var_:
                loss_var_algo += torch.mean(var_val)

            loss = loss_f_i + (mu_mean/2) * loss_var_algo

            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters=model.parameters(), max_norm=max_norm) # Clip gradients
            optimizer.step()
    theirs = code_rounds(x, y, model_fn, train, sample_weights())
    ours = fedflat_run(["algo=fedavg-man", f"algo.mu={mu_mean}", "algo.weighting=samples"], x, y, model_fn, max_norm,
                       "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)


# ---------------------------------------------------------------- FedNSAM


@pytest.mark.parametrize("momentum", ["nesterov", "code"])
def test_fednsam_three_rounds_by_hand(tiny, momentum):
    """fednsam: start at w + lam m, eps = -rho m/||m|| at every step; the server's momentum (or the code's rule)."""
    rho, lam = 0.2, 0.5
    sim = Simulation(tiny(*FULL_BATCH, "algo=fednsam", f"algo.rho={rho}", f"algo.lam={lam}",
                          f"algo.momentum={momentum}", "rounds=3"))
    hand = Hand(sim)
    w, m = sim.server.w.clone(), torch.zeros_like(sim.server.w)
    for t in range(3):
        w_hat = w + lam * m
        eps = None if t == 0 else -rho * hand.unit(m)
        mean = torch.stack([hand.local(w_hat, i, sim.server.lr_at(t), perturb=lambda k, wk: eps)
                            for i in _sampled(sim, t)]).mean(0) - w_hat
        m = lam * m + mean if momentum == "nesterov" else (mean if t == 0 else (1 + lam) * mean)
        w = w + m
    rounds(sim, 3)
    close(sim.server.w, w)


def test_fednsam_reductions_and_composition(tiny):
    """rho 0 and lam 0 is FedAvg bit for bit; the perturbation needs the server's momentum, so it is refused with a
    server that has none, naming the ones that do."""
    avg = run(tiny("algo=fedavg", "rounds=2"))
    assert torch.equal(run(tiny("algo=fednsam", "algo.rho=0", "algo.lam=0", "rounds=2")).final_parameters,
                       avg.final_parameters)
    assert run(tiny("algo=fedacg", "algo.perturbation=nsam", "rounds=2")).summary["status"] == "completed"
    with pytest.raises(AlgorithmError, match=r"perturbation 'nsam' needs \['acg.m'\].*server 'acg' or server 'nsam'"):
        build_algorithm({"name": "fedsam", "perturbation": "nsam"})
    seq = run(tiny("algo=fednsam", "engine=sequential"))
    vec = run(tiny("algo=fednsam", "engine=vectorized"))
    close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)


class SAM(torch.optim.Optimizer):
    """Transcribed unmodified from github.com/junkangLiu0/FedNSAM (sam.py, commit c3c9e90), which update_NSAM uses."""

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        assert rho >= 0.0, f"Invalid rho, should be non-negative: {rho}"

        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super(SAM, self).__init__(params, defaults)

        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)

            for p in group["params"]:
                if p.grad is None: continue  # noqa: E701
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"

        if zero_grad: self.zero_grad()  # noqa: E701

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None: continue  # noqa: E701
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"

                #p.add_(e_w)  # climb to the local maximum "w + e(w)"

        self.base_optimizer.step()  # do the actual "sharpness-aware" update

        if zero_grad: self.zero_grad()  # noqa: E701

    def _grad_norm(self):
        shared_device = self.param_groups[0]["params"][0].device  # put everything on the same device, in case of model parallelism
        norm = torch.norm(
                    torch.stack([
                        ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
                        for group in self.param_groups for p in group["params"]
                        if p.grad is not None
                    ]),
                    p=2
               )
        return norm


device = torch.device("cpu")  # main_FedNSAM.py's module global, which its functions below read


class NSAMWorker(AuthorsWorker):
    """main_FedNSAM.py's worker around ``update_NSAM`` (l.1082-1127), transcribed unmodified."""

    def update_NSAM(self, weights, E, index, ps_c, lr):
        if ps_c == {}:
            ps_c = {k: torch.zeros_like(v, device='cpu') for k, v in self.model.state_dict().items()}
        args.gamma=0.85
        args.rho=0.05
        for k, v in weights.items():
            if k in ps_c.keys():
                weights[k] = weights[k] + ps_c[k] * args.gamma
                weights[k] = weights[k].to(device)
        self.model.load_state_dict(weights)
        self.model.to(device)
        self.data_id_loader(index)
        for name, param in self.model.named_parameters():
            if "classifier" in name or "head" in name:
                param.requires_grad = True
        base_optimizer = torch.optim.SGD
        self.optimizer = SAM(self.model.parameters(), base_optimizer, lr=lr, weight_decay=0.001, rho=args.rho)
        step = 0  # 新增步数计数
        self.loss = 0
        for e in range(E):
            for batch_idx, (data, target) in enumerate(self.data_iterator):
                if step >= args.K:
                    break
                step = step + 1
                data = data.to(device)
                target = target.to(device)
                self.model.zero_grad()
                output = self.model(data)
                loss = self.criterion(output, target)
                self.loss += loss.item() / args.K
                loss.backward()
                self.optimizer.first_step(zero_grad=True)
                self.criterion(self.model(data), target).backward()
                torch.nn.utils.clip_grad_norm_(parameters=self.model.parameters(), max_norm=10)
                self.optimizer.second_step(zero_grad=True)
        if args.lora == 1:
            delta_w = {k: v.cpu() for k, v in self.model.state_dict().items() if 'lora' in k or "classifier" in k or "head" in k}
            for k, v in self.model.state_dict().items():
                if 'lora' in k or "classifier" in k or "head" in k:
                    delta_w[k] = v.cpu() - weights[k].cpu()
        else:
            delta_w = {k: v.cpu() for k, v in self.model.state_dict().items()}
            for k, v in self.model.state_dict().items():
                delta_w[k] = v.cpu() - weights[k].cpu()
        self.model.to("cpu")
        torch.cuda.empty_cache()
        return delta_w


def apply_weights_avgACG(num_workers, weights,model,momen_m):
    """Transcribed unmodified from main_FedNSAM.py (l.1355-1374), the server of FedACG and FedNSAM there."""
    model.to('cpu')
    gamma = args.gamma
    ps_w = {k: v.cpu() for k, v in model.state_dict().items()}
    sum_weights = {}
    for weight in weights:
        for k, v in weight.items():
            if k in sum_weights.keys():
                sum_weights[k] += 1 / (args.num_workers * args.selection) * v
            else:
                sum_weights[k] = 1 / (args.num_workers * args.selection) * v
    if momen_m == {}:
        momen_m = deepcopy(sum_weights)
    else:
        for k, v in sum_weights.items():
            momen_m[k] = gamma * v + sum_weights[k]
    for k, v in sum_weights.items():
        ps_w[k] = ps_w[k] + momen_m[k]
    model.load_state_dict(ps_w)
    return {k: v.cpu() for k, v in model.state_dict().items()}, momen_m


args = SimpleNamespace(gamma=0.85, rho=0.05, K=10**6, lora=0, num_workers=4, selection=1.0)


def test_fednsam_code_equals_the_authors_code_on_the_conformance_problem():
    """Three rounds of the authors' ``update_NSAM`` and ``apply_weights_avgACG`` (with sam.py's SAM) on
    scripts/conformance.py's problem against ``fednsam-code`` with the code's weight decay 1e-3 and clip 10 (on the
    perturbed gradient, as ``clip_scope=loss``): equal to float32 rounding."""
    from conformance import CLIENTS, LR, LR_DECAY, ROUNDS, STEPS, fedflat_run, problem, shares

    x, y, model_fn = problem()
    server = WeightsModel(*model_fn())
    workers = [NSAMWorker(WeightsModel(*model_fn()), xi, yi) for xi, yi in shares(x, y)]
    momen_m, theirs = {}, []
    for t in range(ROUNDS):
        deltas = [w.update_NSAM({k: v.clone() for k, v in server.state_dict().items()}, STEPS, i, momen_m,
                                LR * LR_DECAY ** t) for i, w in enumerate(workers)]
        _, momen_m = apply_weights_avgACG(CLIENTS, deltas, server, momen_m)
        theirs.append(torch.nn.utils.parameters_to_vector(server.parameters()).detach().clone())
    ours = fedflat_run(["algo=fednsam-code", "train.weight_decay=0.001"], x, y, model_fn, 10.0, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)


# ---------------------------------------------------------------- FedFSA


def hand_sensitive(layout, after: torch.Tensor, before: torch.Tensor, top: int) -> torch.Tensor:
    """The mask of the ``top`` weight tensors of largest mean squared change of their min-max normalized entries."""
    def mm(v):
        return (v - v.min()) / (v.max() - v.min())
    scores = []
    for name, a, b in zip(layout.names, layout.segments(after), layout.segments(before)):
        scores.append(-1.0 if "bias" in name else float(((mm(a) - mm(b)) ** 2).mean()))
    chosen = sorted(range(len(scores)), key=lambda j: -scores[j])[:top]
    return torch.cat([torch.full_like(seg, float(j in chosen)) for j, seg in enumerate(layout.segments(after))])


def test_fedfsa_three_rounds_by_hand(tiny):
    """Radii rho_larger on each returning client's most sensitive weight tensor of its last round (rho elsewhere; all
    rho at first), MoFedSAM's momentum-mixed step."""
    rho, larger, a = 0.05, 0.5, 0.1
    sim = Simulation(tiny(*FULL_BATCH, "algo=fedfsa", f"algo.rho={rho}", f"algo.rho_larger={larger}", "algo.top=1",
                          "rounds=3"))
    hand, layout = Hand(sim), sim.settings.layout
    w, m, mask = sim.server.w.clone(), torch.zeros_like(sim.server.w), {}
    for t in range(3):
        lr, finals = sim.server.lr_at(t), []
        for i in _sampled(sim, t):
            r = rho + (larger - rho) * mask.get(i, torch.zeros_like(w))
            wf = hand.local(w, i, lr, perturb=lambda k, wk, i=i, r=r: r * hand.unit(hand.grad(wk, i)),
                            direction=lambda k, wk, g: mix(a, g, m, wk, hand.wd))
            mask[i] = hand_sensitive(layout, wf, w, 1)
            finals.append(wf)
        W = torch.stack(finals)
        m = (-(W - w) / (STEPS * lr)).mean(0)
        w = W.mean(0)
    assert set(_sampled(sim, 1)) & set(_sampled(sim, 0)), "the test needs a returning client"
    rounds(sim, 3)
    close(sim.server.w, w)
    for i, expected in mask.items():
        assert torch.equal(sim.server.store.get("fsa.larger", torch.tensor([i]))[0][0], expected)


def test_fedfsa_with_equal_radii_is_mofedsam_and_runs_on_both_engines(tiny):
    same = run(tiny("algo=fedfsa", "algo.rho=0.1", "algo.rho_larger=0.1", "rounds=2"))
    mo = run(tiny("algo=mofedsam", "algo.rho=0.1", "rounds=2"))
    close(same.final_parameters, mo.final_parameters, rtol=1e-5, atol=1e-6)
    seq = run(tiny("algo=fedfsa", "engine=sequential"))
    vec = run(tiny("algo=fedfsa", "engine=vectorized"))
    close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)


class FSA(torch.optim.Optimizer):
    """Transcribed unmodified from github.com/xxdznl/FedFSA (FedFSA/samOptimizers/FSA.py, commit 6cc0228), the
    authors' optimizer (its commented-out alternatives left out)."""

    def __init__(self, params, base_optimizer,cid,rho_default, rho_larger, adaptive=False, **kwargs):
        assert rho_default >= 0.0 and rho_larger >= 0.0, f"Invalid perturbation amplitude, should be non-negative: rho_default({rho_default}) rho_larger({rho_larger})"
        defaults = dict(rho_default=rho_default,rho_larger=rho_larger, adaptive=adaptive, **kwargs)
        super(FSA, self).__init__(params, defaults)
        self.cid = cid
        self.param_groups = base_optimizer.param_groups
        for group in self.param_groups:
            group["rho"] = rho_default
            group["rho_larger"] = rho_larger
            group["adaptive"] = adaptive

    @torch.no_grad()
    def first_step(self,max2Layer=[]):
        #first order sum
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = 1 / (grad_norm + 1e-7)
            for idx, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if idx not in max2Layer:#
                    e_w = p.grad * group["rho"] * scale.to(p)
                else:
                    e_w = p.grad * group["rho_larger"] * scale.to(p)
                p.add_(e_w * 1)
                self.state[p]["e_w"] = e_w
    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for idx,p in enumerate(group["params"]):
                if p.grad is None or not self.state[p]:
                    continue
                # go back to "w" from "w + e(w)"
                p.sub_(self.state[p]["e_w"])
                self.state[p]["e_w"] = 0

    def _grad_norm(self):
        norm = torch.norm(torch.stack([
                        ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2)
                        for group in self.param_groups for p in group["params"]
                        if p.grad is not None]), p=2)
        return norm

    def nextDisruptLayer(self, global_params,local_named_params,TopC):
        # Calculate the perturbation sensitivity of each layer, only considering the weights
        perturbation_sensitivity = [0 if any(keyword in name.lower() for keyword in ["bn","downsample","shortcut", "norm", "bias"])\
                else self.compute_perturbation_sensitivity(paramAfter, paramBefore) \
                for (name, paramAfter), paramBefore in zip(local_named_params, global_params)]
        # Normalization and ranking
        normalized_perturbation_sensitivity = self.normalize(torch.tensor(perturbation_sensitivity))
        ranked_perturbation_sensitivity = sorted(enumerate(normalized_perturbation_sensitivity), key=lambda x: x[1] \
                                            if not torch.isnan(x[1]) else float('-inf'), reverse=True)
        max2Layer = [original_idx for idx, (original_idx, _) in enumerate(ranked_perturbation_sensitivity) if idx < TopC]
        return max2Layer

    # compute perturbation sensitivity
    def compute_perturbation_sensitivity(self,paramAfter,paramBefore):
        return torch.mean((self.normalize(paramAfter) - self.normalize(paramBefore))**2)
    # min-max normalization
    def normalize(self, data):
        min_val = torch.min(data)
        max_val = torch.max(data)
        return (data - min_val) / (max_val - min_val)


def test_fedfsa_equals_the_authors_code_on_the_conformance_problem():
    """Three rounds of the authors' client step (``ClientFedFSA.train_cnn`` without ``last``: clip, ``first_step``
    with the client's ``max2Layer``, ``alpha`` times the perturbed loss, ``(1 - alpha) <w, Client_momentum>``, clip,
    SGD; then ``nextDisruptLayer``) with ``FSA`` transcribed and the server's ``Client_momentum = -mean Delta / (E
    lr)`` (``lr_decay`` 1, as its FedFSA runs), on scripts/conformance.py's problem (``TopC`` 1 of its two weight
    tensors, a constant rate), against ``fedfsa``: equal to float32 rounding, and the same layers chosen."""
    from conformance import CLIENTS, LR, ROUNDS, STEPS, WD, fedflat_run, problem, shares

    rho_default, rho_larger, alpha, top, max_norm = 0.05, 0.5, 0.1, 1, 10.0
    x, y, model_fn = problem()
    server, momentum, chosen, theirs = model_fn(), None, [[] for _ in range(CLIENTS)], []
    for t in range(ROUNDS):
        updates = []
        for i in range(CLIENTS):
            model = model_fn()
            model.load_state_dict(server.state_dict())
            params_list = [param.clone().detach() for param in model.parameters()]
            base_optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0, weight_decay=WD)
            optimizer = FSA(model.parameters(), base_optimizer, cid=i, rho_default=rho_default, rho_larger=rho_larger)
            images, labels = shares(x, y)[i]
            delta = torch.zeros(sum(p.numel() for p in model.parameters())) if momentum is None else momentum
            for _ in range(STEPS):
                total_loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                total_loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters=model.parameters(), max_norm=max_norm)
                optimizer.first_step(max2Layer=chosen[i])
                total_loss2 = alpha * F.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                total_loss2.backward()
                optimizer.second_step()
                param_list = torch.nn.utils.parameters_to_vector(model.parameters())
                loss_correct = (1 - alpha) * torch.sum(param_list * delta)
                loss_correct.backward()
                torch.nn.utils.clip_grad_norm_(parameters=model.parameters(), max_norm=max_norm)
                base_optimizer.step()
            with torch.no_grad():
                chosen[i] = optimizer.nextDisruptLayer(params_list, model.named_parameters(), TopC=top)
            updates.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach()
                           - torch.nn.utils.parameters_to_vector(server.parameters()).detach())
        mean = torch.stack(updates).mean(0)
        momentum = mean / STEPS / LR * -1.
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(server.parameters()) + mean,
                                            server.parameters())
        theirs.append(torch.nn.utils.parameters_to_vector(server.parameters()).detach().clone())
    ours = fedflat_run(["algo=fedfsa", f"algo.rho={rho_default}", f"algo.rho_larger={rho_larger}", f"algo.top={top}",
                        f"algo.a={alpha}", "train.lr_decay=1.0"], x, y, model_fn, max_norm, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)
    assert all(c in ([0], [2]) for c in chosen)  # a weight tensor each
    equal = fedflat_run(["algo=fedfsa", f"algo.rho={rho_default}", f"algo.rho_larger={rho_default}",
                         f"algo.a={alpha}", "train.lr_decay=1.0"], x, y, model_fn, max_norm, "loss")
    assert (equal[-1] - theirs[-1]).abs().max() > 1e-5  # the larger radius on the chosen tensors matters


# ---------------------------------------------------------------- every method: listed, executors, Flower

NEW = ["fedasam", "fedavg-swa", "fedsam-swa", "fedasam-swa", "fedsol", "fedswa", "fedmoswa", "fedavg-man", "fedsam-man",
       "fednsam", "fednsam-code", "fedfsa"]
# the compositions that exercise each new hook: the server's round rate, the step schedule, the activation penalty
ACROSS = [("fedasam-swa", "algo.start_round=1", "algo.cycle=2"), ("fedmoswa", "algo.rho=0.1"), ("fedsam-man",),
          ("fedsol",), ("fednsam",), ("fedfsa",)]


def test_every_new_method_is_listed_with_its_source():
    for name in NEW:
        assert RECIPES[name].source and RECIPES[name].summary, name
        build_algorithm({"name": name})
    listed = subprocess_list()
    for name in NEW:
        assert name in listed and RECIPES[name].source in listed, name


def subprocess_list() -> str:
    import os
    import subprocess

    done = subprocess.run([sys.executable, "-m", "fedflat.cli", "list"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("method", ACROSS, ids=[m[0] for m in ACROSS])
def test_threads_equal_the_local_executor(tiny, method):
    name, *options = method
    cfg = tiny(f"algo={name}", *options, "rounds=3", "engine=sequential")
    local = run(cfg)
    threaded = fedflat.run(cfg, overrides=["executor=threads", "executor.workers=2"], save=False, progress=False)
    assert torch.equal(threaded.final_parameters, local.final_parameters)
    assert [m["lr"] for m in threaded.metrics] == [m["lr"] for m in local.metrics]


@pytest.mark.slow  # Ray workers and a Flower simulation per method
@pytest.mark.parametrize("method", ACROSS, ids=[m[0] for m in ACROSS])
def test_ray_and_flower_equal_the_local_executor(tiny, method, tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("flwr")
    from fedflat.flower.apps import simulate

    name, *options = method
    cfg = tiny(f"algo={name}", *options, "rounds=3", "engine=sequential")
    local = run(cfg)
    on_ray = fedflat.run(cfg, overrides=["executor=ray", "executor.workers=2", "executor.cpus_per_worker=0.5"],
                         save=False, progress=False)
    assert torch.equal(on_ray.final_parameters, local.final_parameters)
    on_flower = simulate(cfg, supernodes=2, out=tmp_path / "flower", progress=False)
    assert torch.equal(on_flower.final_parameters, local.final_parameters)


def test_the_new_methods_under_robust_rules_and_compression(tiny):
    """They read only the aggregate (or keep their state on the client), so a robust rule and top-k compression
    apply; each run completes and differs from the plain run."""
    for name, *options in ACROSS:
        plain = run(tiny(f"algo={name}", *options, "rounds=2"))
        for extra in (("robust.name=median",), ("compression.name=topk", "compression.ratio=0.5")):
            other = run(tiny(f"algo={name}", *options, "rounds=2", *extra))
            assert other.summary["status"] == "completed", (name, extra)
            assert not torch.equal(other.final_parameters, plain.final_parameters), (name, extra)


@pytest.mark.slow  # fedflat.testing.check_part per part: ~6 s each
@pytest.mark.parametrize("role, name, recipe, algo", [
    ("perturbation", "asam", "fedasam", None),
    ("server", "swa", "fedavg-swa", {"server": {"name": "swa", "start_round": 1, "cycle": 2}}),  # extending keeps it
    ("perturbation", "sol", "fedsol", None), ("correction", "swa", "fedswa", None),
    ("correction", "moswa", "fedmoswa", None), ("filter", "man", "fedavg-man", None),
    ("server", "nsam", "fednsam", None), ("perturbation", "fsa", "fedfsa", None)])
def test_every_new_part_passes_check_part(role, name, recipe, algo):
    """The contract kept, the engines agreeing, the part in another method, a resumed run bit for bit."""
    from fedflat.core import PARTS
    from fedflat.testing import check_part

    report = check_part(PARTS[role][name], recipe=recipe, algo=algo)
    assert report["contract"] == "kept" and report["checkpoint"] == "resumed after round 2: bit for bit"
