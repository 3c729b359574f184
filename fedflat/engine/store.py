"""The client-state store: per-client flat vectors (SCAFFOLD's ``c_i``, FedDyn's ``h_i``, ...).

Vectors exist only for clients that have participated; a client never seen reads as zeros with
``present = False``. Parts read and write whole cohorts at once (leading client dimension).

Vectors are kept in CPU memory up to a byte budget (``store.memory_mb``); beyond it they are
*spilled* to memory-mapped files on disk, one growable ``[rows, P]`` file per name, so a
thousand-client cross-device run with a ResNet-18 (45 MB per vector) does not need the state in
RAM. Which tier holds a vector never changes its value: reads return exactly what was written.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


class _SpillFile:
    """One name's spilled vectors: rows of a memory-mapped ``[capacity, P]`` file, grown by doubling."""

    def __init__(self, path: Path, size: int, dtype: np.dtype):
        self.path, self.size, self.dtype = path, size, np.dtype(dtype)
        self.rows: dict[int, int] = {}
        self.capacity = 0
        self.array: np.memmap | None = None

    def _grow(self) -> None:
        capacity = max(4, 2 * self.capacity)
        if self.array is not None:
            self.array.flush()
            self.array = None
        with open(self.path, "ab") as f:
            f.truncate(capacity * self.size * self.dtype.itemsize)
        self.array = np.memmap(self.path, dtype=self.dtype, mode="r+", shape=(capacity, self.size))
        self.capacity = capacity

    def write(self, key: int, vector: np.ndarray) -> None:
        if key not in self.rows:
            if len(self.rows) == self.capacity:
                self._grow()
            self.rows[key] = len(self.rows)
        self.array[self.rows[key]] = vector

    def read(self, key: int) -> np.ndarray:
        return self.array[self.rows[key]]

    def snapshot(self, path: Path) -> dict[int, torch.Tensor]:
        """Views of a private copy of the file: later writes to the store do not change them, and
        the copy lives on disk, not in RAM (unlinked at once on POSIX; the mapping keeps it alive)."""
        if not self.rows:
            return {}
        self.array.flush()
        shutil.copyfile(self.path, path)
        copy = np.memmap(path, dtype=self.dtype, mode="c", shape=(self.capacity, self.size))
        try:
            os.unlink(path)
        except OSError:  # platforms that cannot unlink a mapped file: removed with the store folder
            pass
        return {key: torch.from_numpy(copy[row]) for key, row in self.rows.items()}


class ClientStore:
    """Named per-client vectors of length ``P``, kept only for participating clients.

    ``memory_mb``: CPU-memory budget for all names together (``None``: unlimited); vectors beyond it
    go to memory-mapped files under ``directory`` (default: a temporary folder), removed when the
    store is closed, garbage-collected, or the interpreter exits. Vectors are returned on ``device``.
    ``widths`` gives names whose vectors have their own length and dtype (a client's own buffers, FedBN's
    statistics: ``Q`` entries in float64).
    """

    def __init__(self, size: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 memory_mb: float | None = None, directory: str | Path | None = None,
                 widths: dict[str, tuple[int, torch.dtype]] | None = None):
        for d in [dtype, *(d for _, d in (widths or {}).values())]:
            if d not in _NUMPY_DTYPES:
                raise ValueError(f"ClientStore dtype must be one of {sorted(map(str, _NUMPY_DTYPES))}, got {d}")
        if memory_mb is not None and memory_mb < 0:
            raise ValueError(f"store memory budget must be >= 0 MB, got {memory_mb}")
        self.size = size
        self.device = torch.device(device)
        self.dtype = dtype
        self.widths = dict(widths or {})
        self.budget = None if memory_mb is None else int(memory_mb * 2 ** 20)
        self.parent = Path(directory) if directory is not None else None
        self._memory: dict[str, dict[int, torch.Tensor]] = {}
        self._disk: dict[str, _SpillFile] = {}
        self._folder: Path | None = None
        self._snapshots = 0
        self._cleanup: weakref.finalize | None = None

    # -- accounting ----------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, torch.dtype]:
        """``(length, dtype)`` of the vectors called ``name``."""
        return self.widths.get(name, (self.size, self.dtype))

    def vector_bytes(self, name: str) -> int:
        size, dtype = self.shape(name)
        return size * torch.empty(0, dtype=dtype).element_size()

    @property
    def memory_bytes(self) -> int:
        """Bytes of vectors held in CPU memory."""
        return sum(self.vector_bytes(name) * len(slot) for name, slot in self._memory.items())

    @property
    def disk_bytes(self) -> int:
        """Bytes of vectors spilled to disk (live rows, not file capacity)."""
        return sum(self.vector_bytes(name) * len(f.rows) for name, f in self._disk.items())

    def names(self) -> list[str]:
        return sorted(set(self._memory) | set(self._disk))

    def count(self, name: str | None = None) -> int:
        """How many clients hold a vector called ``name`` (all names together when ``None``)."""
        if name is None:
            return sum(self.count(n) for n in self.names())
        return len(self._memory.get(name, {})) + len(self._disk[name].rows if name in self._disk else {})

    def spilled(self, name: str | None = None) -> int:
        """How many of those vectors live on disk."""
        if name is None:
            return sum(len(f.rows) for f in self._disk.values())
        return len(self._disk[name].rows) if name in self._disk else 0

    # -- reads and writes ----------------------------------------------------------------------
    def get(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values[C, P], present[C])`` for the clients ``ids``; zeros where absent."""
        memory, disk = self._memory.get(name, {}), self._disk.get(name)
        keys = ids.tolist()
        size, dtype = self.shape(name)
        values = torch.zeros(len(keys), size, dtype=dtype)
        present = torch.zeros(len(keys), dtype=torch.bool)
        for row, key in enumerate(keys):
            if key in memory:
                values[row] = memory[key]
            elif disk is not None and key in disk.rows:
                values[row] = torch.from_numpy(disk.read(key))
            else:
                continue
            present[row] = True
        return values.to(self.device), present.to(self.device)

    def put(self, name: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Stores ``values[C, P]`` for the clients ``ids``."""
        size, dtype = self.shape(name)
        if values.shape != (len(ids), size):
            raise ValueError(f"store '{name}': expected values of shape ({len(ids)}, {size}), "
                             f"got {tuple(values.shape)}")
        rows = values.detach().to("cpu", dtype)
        for row, key in enumerate(ids.tolist()):
            self._put_one(name, int(key), rows[row])

    def _put_one(self, name: str, key: int, vector: torch.Tensor) -> None:
        memory = self._memory.setdefault(name, {})
        disk = self._disk.get(name)
        on_disk = disk is not None and key in disk.rows
        if key in memory or (not on_disk and self._fits(name)):
            # A fresh tensor, never written in place: state_dict() can hand out references safely.
            memory[key] = vector.clone()
            return
        if disk is None:
            size, dtype = self.shape(name)
            path = self._spill_folder() / f"{_safe(name)}.bin"
            disk = self._disk[name] = _SpillFile(path, size, _NUMPY_DTYPES[dtype])
        disk.write(key, vector.numpy())

    def _fits(self, name: str) -> bool:
        return self.budget is None or self.memory_bytes + self.vector_bytes(name) <= self.budget

    def _spill_folder(self) -> Path:
        if self._folder is None:
            if self.parent is not None:
                self.parent.mkdir(parents=True, exist_ok=True)
            self._folder = Path(tempfile.mkdtemp(prefix="fedflat-store-", dir=self.parent))
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._folder, True)
        return self._folder

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        """``{name: {client: vector}}`` of every stored vector, spilled ones included.

        A snapshot: later writes to the store do not change it. Spilled vectors come as views of a
        disk copy of their file (not loaded into RAM), so saving the state of a large store streams
        from disk.
        """
        state = {name: dict(slot) for name, slot in self._memory.items()}
        for name, disk in self._disk.items():
            self._snapshots += 1
            state.setdefault(name, {}).update(disk.snapshot(self._spill_folder() / f"snapshot-{self._snapshots}.bin"))
        return state

    def load_state_dict(self, state: dict[str, dict[int, torch.Tensor]]) -> None:
        """Replaces the store's content; vectors fill memory up to the budget and spill beyond it."""
        self.clear()
        for name, slot in state.items():
            size, dtype = self.shape(name)
            for key, vector in slot.items():
                if vector.shape != (size,):
                    raise ValueError(f"store state '{name}'[{key}] has shape {tuple(vector.shape)}, "
                                     f"expected ({size},)")
                self._put_one(name, int(key), vector.detach().to("cpu", dtype))

    def clear(self) -> None:
        """Forgets every vector (spill files are truncated away when rewritten)."""
        self._memory.clear()
        for disk in self._disk.values():
            disk.array = None
            disk.path.unlink(missing_ok=True)
        self._disk.clear()

    def close(self) -> None:
        """Drops every vector and removes the spill folder."""
        self.clear()
        if self._cleanup is not None:
            self._cleanup()
            self._folder, self._cleanup = None, None


def _safe(name: str) -> str:
    """A file name for a vector name (``scaffold.c_i`` -> ``scaffold.c_i``; odd characters replaced)."""
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
