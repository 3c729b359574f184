"""The federated-SAM methods of issue 56 against hand computations, their reductions and compositions: FedASAM,
server-side SWA, FedSOL, FedSWA/FedMoSWA, FedMAN (docs/algorithms.md). Hand computations use full-batch local
steps, each gradient computed directly with autograd on the model (tests/test_sam_family.py's ``Hand``)."""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import fedflat
from fedflat.algorithms import RECIPES, AlgorithmError, build_algorithm
from fedflat.engine.simulation import Simulation
from test_sam_family import FULL_BATCH, STEPS, Hand, _sampled, close, rounds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # conformance.py's problem


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
    mask = torch.cat([torch.full((n,), "weight" in name) for name, n in zip(layout.names, layout.numels)])
    assert mask.any() and not mask.all(), "the model needs weights and biases for the test to tell them apart"
    w = sim.w.clone()
    for t in range(2):
        finals = [hand.local(w, i, sim.lr_at(t),
                             perturb=lambda k, wk, i=i: asam_eps(hand, wk, i, rho, eta,
                                                                 mask if normalize == "weights" else None))
                  for i in _sampled(sim, t)]
        w = torch.stack(finals).mean(0)
    rounds(sim)
    close(sim.w, w)


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
    clip) over full-batch steps, the server's sample-weighted average (equal sizes: the mean)."""
    from conformance import CLIENTS, LR, LR_DECAY, ROUNDS, SAMPLES, STEPS, WD

    server = model_fn()
    models = []
    for t in range(ROUNDS):
        finals = []
        for i in range(CLIENTS):
            client = model_fn()
            client.load_state_dict(server.state_dict())
            optimizer = torch.optim.SGD(client.parameters(), lr=LR * LR_DECAY ** t, weight_decay=WD)
            minimizer = ASAM(optimizer, client, rho, eta)
            xi, yi = x[i * SAMPLES:(i + 1) * SAMPLES], y[i * SAMPLES:(i + 1) * SAMPLES]
            for _ in range(STEPS):
                torch.nn.functional.cross_entropy(client(xi), yi).backward()
                minimizer.ascent_step()
                torch.nn.functional.cross_entropy(client(xi), yi).backward()
                minimizer.descent_step()
            finals.append(torch.cat([p.detach().reshape(-1) for p in client.parameters()]))
        mean = torch.stack(finals).mean(0)
        torch.nn.utils.vector_to_parameters(mean, server.parameters())
        models.append(mean)
    return models


def test_fedasam_equals_the_authors_code_on_the_conformance_problem():
    """Three rounds of the authors' minimizer (transcribed) and of fedflat's ``fedasam`` (its default
    ``normalize=weights``) on scripts/conformance.py's problem: the global models agree to float32 rounding (entries
    of order 0.16; the codes' norm guards 1e-16 and 1e-12 differ below it)."""
    from conformance import fedflat_run, problem

    x, y, model_fn = problem()
    rho, eta = 0.5, 0.2
    theirs = authors_fedasam(x, y, model_fn, rho, eta)
    ours = fedflat_run(["algo=fedasam", f"algo.rho={rho}", f"algo.eta={eta}"], x, y, model_fn, None, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)
    everything = fedflat_run(["algo=fedasam", f"algo.rho={rho}", f"algo.eta={eta}", "algo.normalize=all"], x, y,
                             model_fn, None, "loss")
    assert (everything[-1] - theirs[-1]).abs().max() > 1e-5  # the biases' T tells the options apart
