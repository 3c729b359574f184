"""fedflat's native MLP gradient (:mod:`fedflat.engine.native`): built once per machine, loaded by every process,
run with the GIL released, and replaced by the Python method (same numbers) where it cannot be built. Its bits are
tested against autograd in tests/test_mlp_gradient.py (``path=native``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fedflat
from fedflat.engine import native
from fedflat.engine.mlp_gradient import MLPGradient
from fedflat.models.mlp import mlp
from fedflat.params import FlatModel
from fedflat.testing import TINY

ROOT = Path(__file__).resolve().parent.parent


def require_native(hand: MLPGradient) -> None:
    """Skips where this machine has no C++ compiler; fails where it has one and the operator did not load."""
    if native.compiler() is None or not native.enabled():
        pytest.skip("no C++ compiler here (or FEDFLAT_NATIVE=0): the native MLP gradient cannot be built")
    assert hand.native is not None, native.status()


def _big_problem() -> tuple[MLPGradient, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = FlatModel(mlp((1024,), 10, (1024, 1024)))
    hand = MLPGradient.of(model)
    require_native(hand)
    return hand, model.initial.clone(), torch.randn(1024, 1024), torch.randint(0, 10, (1024,))


def _ticks_during(call) -> tuple[int, float]:
    """How many times a pure-Python thread ran its loop while ``call()`` ran in this thread, and the call's seconds."""
    ticks: list[float] = []
    running, done = threading.Event(), threading.Event()

    def spin() -> None:  # sleeps between ticks (releasing the GIL), so the caller never waits for it to switch
        running.set()
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(1e-4)

    other = threading.Thread(target=spin, daemon=True)
    other.start()
    running.wait()
    start = time.perf_counter()
    call()
    end = time.perf_counter()
    done.set()
    other.join()
    return sum(start < t < end for t in ticks), end - start


def test_the_native_call_releases_the_gil():
    """While one thread is inside the native operator (a 1024-wide MLP on 1024 samples: tens of milliseconds), a
    pure-Python thread keeps running; the same check sees no progress at all during ``sorted`` of a shuffled list of
    ints, a C call that holds the GIL (so the check can fail)."""
    hand, w, x, y = _big_problem()
    torch.set_num_threads(1)
    ticks, seconds = _ticks_during(lambda: hand.loss_grad(w, x, y))
    assert seconds > 0.02 and ticks >= 5
    data = torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0)).tolist()
    held, held_seconds = _ticks_during(lambda: sorted(data))
    assert held_seconds > 0.02 and held <= 2  # (a tick may land on either side of the GIL hand-over)


def test_off_switch(monkeypatch):
    """``FEDFLAT_NATIVE=0`` keeps the Python method, and the status line says so."""
    monkeypatch.setenv("FEDFLAT_NATIVE", "0")
    assert native.load() is None and MLPGradient.of(FlatModel(mlp((4,), 3, (5,)))).native is None
    assert "off" in native.status()


def _python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


RUN_TINY = """
import json, warnings, fedflat
from fedflat.engine import native
from fedflat.testing import TINY
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    op = native.load()
    w = fedflat.run({**TINY, "rounds": 2, "algo": {"name": "fedsam"}, "device": "cpu"}, overrides=["engine=sequential"],
                    save=False, progress=False).final_parameters
print(json.dumps({"loaded": op is not None, "status": native.status(), "warnings": [str(c.message) for c in caught],
                  "w": w.double().sum().item(), "bits": w.numpy().tobytes().hex()}))
"""


def test_without_a_compiler_the_python_method_runs_with_the_same_numbers(tmp_path):
    """With no compiler to build it (``CXX`` naming none, an empty cache), the run warns once with the reason and
    ends with the parameters of a run that has the native operator (or of the Python method, off)."""
    missing = json.loads(_python(RUN_TINY, {"CXX": str(tmp_path / "no-compiler"),
                                             "FEDFLAT_CACHE": str(tmp_path / "cache")}).stdout)
    assert not missing["loaded"] and "no C++ compiler" in missing["status"]
    assert sum("not available" in m for m in missing["warnings"]) == 1
    reference = fedflat.run({**TINY, "rounds": 2, "algo": {"name": "fedsam"}, "device": "cpu"},
                            overrides=["engine=sequential"], save=False, progress=False).final_parameters
    assert reference.numpy().tobytes().hex() == missing["bits"]


@pytest.mark.slow
def test_concurrent_builds_make_one_library_and_a_damaged_one_is_rebuilt(tmp_path):
    """Two processes loading into an empty cache at once build one library and leave no partial file; a damaged
    library (truncated, as a full disk leaves it) is rebuilt on load, and the runs' numbers equal the Python
    method's."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler here")
    env = {"FEDFLAT_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", RUN_TINY], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    assert all(r["loaded"] for r in results)
    files = sorted(p.name for p in (tmp_path / "cache" / "native").rglob("*") if p.is_file())
    assert files == ["libfedflat_native.so", "libfedflat_native.so.sha256", "lock"]
    library = next((tmp_path / "cache" / "native").rglob("libfedflat_native.so"))
    library.write_bytes(library.read_bytes()[:4096])
    again = json.loads(_python(RUN_TINY, env, timeout=600).stdout)
    assert again["loaded"] and library.stat().st_size > 4096
    python = json.loads(_python(RUN_TINY, {"FEDFLAT_NATIVE": "0"}).stdout)
    assert {r["bits"] for r in [*results, again, python]} == {python["bits"]}
