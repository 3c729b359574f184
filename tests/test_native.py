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
from fedflat.engine.gradients.hand import MLPGradient
from fedflat.models.mlp import mlp
from fedflat.params import FlatModel
from fedflat.testing import TINY

ROOT = Path(__file__).resolve().parent.parent


def require_native(hand) -> None:
    """Skips where this machine has no C++ compiler; fails where it has one and the operator (the MLP gradient's, or
    the CNN gradient's pooling kernels: ``hand.native``) did not load."""
    if native.compiler() is None or not native.enabled():
        pytest.skip("no C++ compiler here (or FEDFLAT_NATIVE=0): the native operators cannot be built")
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
    done = _python(RUN_TINY, {"CXX": str(tmp_path / "no-compiler"), "FEDFLAT_CACHE": str(tmp_path / "cache")})
    missing = json.loads(done.stdout)
    assert not missing["loaded"] and "no C++ compiler" in missing["status"]
    said = [line for line in done.stderr.splitlines() if "not available" in line]
    assert len(said) == 1 and said[0].startswith("fedflat: warning: the native MLP gradient is not available")
    assert not any("native" in m for m in missing["warnings"])  # one fedflat line, not a UserWarning
    reference = fedflat.run({**TINY, "rounds": 2, "algo": {"name": "fedsam"}, "device": "cpu"},
                            overrides=["engine=sequential"], save=False, progress=False).final_parameters
    assert reference.numpy().tobytes().hex() == missing["bits"]


FAILING_COMPILER = """#!/bin/sh
# a compiler whose builds fail: answers --version (the cache key), counts and fails every compile
if [ "$1" = "--version" ]; then echo "failing-c++ 1.0"; exit 0; fi
echo build >> "$(dirname "$0")/builds"
echo "mlp_gradient.cpp:1:1: error: this compiler always fails" >&2
exit 1
"""


def test_a_failed_build_is_recorded_once_per_machine_and_said_in_one_line(tmp_path):
    """Issue 59: a failing build was tried again, and "building ... once (about 15 s)" announced, in every process,
    its warning a raw UserWarning with a source line. Now the first process tries, records the failure in the cache
    (keyed as the library is) and says so in one fedflat line; the next ones use the Python method at once,
    silently; `python -m fedflat.engine.native` tries again."""
    cxx = tmp_path / "failing-c++"
    cxx.write_text(FAILING_COMPILER)
    cxx.chmod(0o755)
    env = {"CXX": str(cxx), "FEDFLAT_CACHE": str(tmp_path / "cache")}
    code = "from fedflat.engine import native; print(native.load() is None); print(native.status())"
    first, second, third = (_python(code, env) for _ in range(3))
    assert (tmp_path / "builds").read_text().splitlines() == ["build"]  # one try for the machine
    assert first.stdout.splitlines()[0] == "True" and "failing-c++ failed: mlp_gradient.cpp:1:1: error" in first.stdout
    lines = first.stderr.strip().splitlines()
    assert lines[0].startswith("fedflat: building the native MLP gradient once")
    assert len(lines) == 2 and lines[1].startswith("fedflat: warning: the native MLP gradient is not available "
                                                   "(failing-c++ failed: mlp_gradient.cpp:1:1: error")
    assert "UserWarning" not in first.stderr
    for later in (second, third):
        assert later.stderr == "" and "its build failed on this machine" in later.stdout
    (record,) = (tmp_path / "cache" / "native").rglob("build-failed.txt")
    assert "this compiler always fails" in record.read_text()
    again = subprocess.run([sys.executable, "-m", "fedflat.engine.native"], env={**os.environ, "PYTHONPATH": str(ROOT),
                           **env}, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and (tmp_path / "builds").read_text().splitlines() == ["build", "build"]


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


def test_the_summary_says_which_gradient_ran(monkeypatch):
    """summary.json's ``gradient``: the native operator, the same hand-derived gradient in Python (the operator off
    or not built), or autograd (here: the vectorized engine, which the hand-derived gradient does not serve)."""
    config = {**TINY, "rounds": 1, "algo": {"name": "fedsam"}, "device": "cpu"}
    ran = lambda *extra: fedflat.run(config, overrides=["engine=sequential", *extra], save=False,  # noqa: E731
                                     progress=False).summary["gradient"]
    assert fedflat.run(config, overrides=["engine=vectorized"], save=False, progress=False).summary["gradient"] == \
        "autograd"
    if native.compiler() is not None and native.load() is not None:
        assert ran() == "native"
    monkeypatch.setenv("FEDFLAT_NATIVE", "0")
    assert ran() == "python"
