"""``.npy`` files written through a memory map, so that an array larger than memory is never held whole."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np


def write_npy(path: Path, dtype: Any, shape: tuple[int, ...], fill: Callable[[np.ndarray], None]) -> np.ndarray:
    """Makes ``path`` (an ``.npy`` of ``dtype`` and ``shape``): ``fill(array)`` writes into a memory map of a
    temporary file, renamed onto ``path`` once filled, so an interruption or a failure of ``fill`` leaves no
    file. Returns ``path`` memory-mapped read-only."""
    partial = path.with_suffix(".partial.npy")
    array = np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=shape)
    try:
        fill(array)
        array.flush()
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        del array  # the map closed before the file is renamed
    os.replace(partial, path)
    return np.load(path, mmap_mode="r")
