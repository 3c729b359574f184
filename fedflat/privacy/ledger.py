"""The privacy ledger of a run: what its accountant has spent, round by round, and its budget.

Central DP spends one round's mechanism per round, whoever took part (Poisson sampling hides who did): after round
``t`` the run has spent ``epsilon(t + 1)``. Local DP spends per client: a client that released ``n_i`` times has
spent ``epsilon(n_i)``, and the run reports its largest client. Instance-level DP (DP-SGD) spends per local step of
each client: the run reports the bound over its clients, ``epsilon`` of the most steps any client took at the
sampling rate of the smallest client. The ledger's state (each client's count) is checkpointed with the run, so a
resumed run continues the accountant exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedflat.core import BudgetSpent
from fedflat.privacy.accounting import Mechanism, epsilon


@dataclass
class PrivacyLedger:
    """A run's spending and its budget (module docstring); the engine's server makes a run's from its config."""

    mechanism: Mechanism
    delta: float
    budget: float | None  # privacy.target_epsilon: no round may take the run beyond it
    participations: torch.Tensor  # [N]: each client's releases (local DP) or local steps (instance level)

    def epsilon_after(self, round: int, sampled: torch.Tensor, steps: torch.Tensor | None = None) -> float:
        """The run's epsilon once round ``round`` (0-based) has released, with ``sampled`` its clients (and
        ``steps`` their local steps, at the instance level)."""
        m = self.mechanism
        if m.level == "client" and m.mode == "central":
            return epsilon(m, round + 1, self.delta)
        counts = self.participations.clone()
        counts[sampled] += 1 if m.level == "client" else steps.to(counts.dtype)
        return epsilon(m, int(counts.max()), self.delta)

    def check_budget(self, round: int, sampled: torch.Tensor, steps: torch.Tensor) -> None:
        """Refuses a round that would take the run beyond its budget (:class:`BudgetSpent`)."""
        if self.budget is None:
            return
        after = self.epsilon_after(round, sampled, steps)
        if after > self.budget * (1 + 1e-9):
            none = torch.zeros(0, dtype=torch.long)
            spent = self.epsilon_after(round - 1, none, none) if round else 0.0
            raise BudgetSpent(f"privacy budget spent: round {round + 1} would reach epsilon {after:.4g} > "
                              f"privacy.target_epsilon {self.budget:g} (spent {spent:.4g} at delta {self.delta:g})")

    def spend(self, round: int, ids: torch.Tensor, steps: torch.Tensor) -> dict[str, float]:
        """Records round ``round`` with its releasing clients ``ids`` (and their local ``steps``); the round's
        privacy line."""
        value = self.epsilon_after(round, ids, steps)
        self.participations[ids] += 1 if self.mechanism.level == "client" else steps.to(self.participations.dtype)
        return {"epsilon": value}

    def describe(self) -> dict[str, object]:
        """What summary.json says of the accounting."""
        m = self.mechanism
        return {"level": m.level, "mode": m.mode, "accountant": m.accountant, "sampling": m.describe(), "noise_multiplier": m.noise_multiplier,
                "sampling_rate": m.q, "delta": self.delta, "target_epsilon": self.budget}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"participations": self.participations.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.participations = state["participations"].clone()
