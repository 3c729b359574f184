"""The privacy ledger of a run: what its accountant has spent, round by round, and its budget.

Central DP spends one round's mechanism per round, whoever took part (Poisson sampling hides who did): after round
``t`` the run has spent ``epsilon(t + 1)``. Local DP spends per client: a client that released ``n_i`` times has
spent ``epsilon(n_i)``, and the run reports its largest client. The ledger's state (the clients' participations)
is checkpointed with the run, so a resumed run continues the accountant exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedflat.accounting import Mechanism, epsilon
from fedflat.config import Config
from fedflat.core import BudgetSpent


@dataclass
class PrivacyLedger:
    mechanism: Mechanism
    delta: float
    budget: float | None  # privacy.target_epsilon: no round may take the run beyond it
    participations: torch.Tensor  # [N]: rounds each client released in (local DP's accounting)

    @classmethod
    def of(cls, cfg: Config) -> "PrivacyLedger | None":
        if cfg.privacy is None:
            return None
        mechanism = replace(cfg.privacy_mechanism(), noise_multiplier=cfg.noise_multiplier())
        return cls(mechanism, cfg.privacy_delta, cfg.privacy.target_epsilon,
                   torch.zeros(cfg.data.num_clients, dtype=torch.long))

    def epsilon_after(self, round: int, sampled: torch.Tensor) -> float:
        """The run's epsilon once round ``round`` (0-based) has released, with ``sampled`` its clients."""
        if self.mechanism.mode == "central":
            return epsilon(self.mechanism, round + 1, self.delta)
        counts = self.participations.clone()
        counts[sampled] += 1
        return epsilon(self.mechanism, int(counts.max()), self.delta)

    def check_budget(self, round: int, sampled: torch.Tensor) -> None:
        """Refuses a round that would take the run beyond its budget (:class:`BudgetSpent`)."""
        if self.budget is None:
            return
        after = self.epsilon_after(round, sampled)
        if after > self.budget * (1 + 1e-9):
            spent = self.epsilon_after(round - 1, torch.zeros(0, dtype=torch.long)) if round else 0.0
            raise BudgetSpent(f"privacy budget spent: round {round + 1} would reach epsilon {after:.4g} > "
                              f"privacy.target_epsilon {self.budget:g} (spent {spent:.4g} at delta {self.delta:g})")

    def spend(self, round: int, ids: torch.Tensor) -> dict[str, float]:
        """Records round ``round`` with its releasing clients ``ids``; the round's privacy line."""
        value = self.epsilon_after(round, ids)
        self.participations[ids] += 1
        return {"epsilon": value}

    def describe(self) -> dict[str, object]:
        """What summary.json says of the accounting."""
        m = self.mechanism
        return {"mode": m.mode, "accountant": m.accountant, "sampling": m.describe(), "noise_multiplier": m.noise_multiplier,
                "sampling_rate": m.q, "delta": self.delta, "target_epsilon": self.budget}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"participations": self.participations.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.participations = state["participations"].clone()
