"""The client-state store: per-client flat vectors (SCAFFOLD's ``c_i``, FedDyn's ``h_i``, ...).

Vectors exist only for clients that have participated; a client never seen reads as zeros with
``present = False``. Parts read and write whole cohorts at once (leading client dimension).
"""
from __future__ import annotations

import torch


class ClientStore:
    """Named per-client vectors of length ``P``, kept only for participating clients."""

    def __init__(self, size: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.size = size
        self.device = torch.device(device)
        self.dtype = dtype
        self._slots: dict[str, dict[int, torch.Tensor]] = {}

    def get(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values[C, P], present[C])`` for the clients ``ids``; zeros where absent."""
        slot = self._slots.get(name, {})
        keys = ids.tolist()
        values = torch.zeros(len(keys), self.size, device=self.device, dtype=self.dtype)
        present = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
        for row, key in enumerate(keys):
            if key in slot:
                values[row] = slot[key].to(self.device)
                present[row] = True
        return values, present

    def put(self, name: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Stores ``values[C, P]`` for the clients ``ids``."""
        slot = self._slots.setdefault(name, {})
        for row, key in enumerate(ids.tolist()):
            slot[key] = values[row].detach().clone()

    def names(self) -> list[str]:
        return sorted(self._slots)

    def count(self, name: str) -> int:
        """How many clients hold a vector called ``name``."""
        return len(self._slots.get(name, {}))

    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        return {name: {k: v.cpu() for k, v in slot.items()} for name, slot in self._slots.items()}

    def load_state_dict(self, state: dict[str, dict[int, torch.Tensor]]) -> None:
        self._slots = {name: {int(k): v.to(self.device) for k, v in slot.items()} for name, slot in state.items()}
