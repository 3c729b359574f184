"""fedflat's native operators: C++ built once per machine with the system's compiler against the installed torch.

The operators. ``torch.ops.fedflat.mlp_loss_grad`` (``mlp_gradient.cpp`` beside this file): the hand-derived
MLP gradient of :class:`fedflat.engine.gradients.hand.MLPGradient` as one call, bit for bit the Python method's (the
same ATen operations). torch runs an operator called through ``torch.ops`` with the GIL released, so a step's ~35
Python-level operator calls become one GIL-free call: faster on one thread, and two client threads
(``executor: threads``) no longer queue for the GIL around every small operation (docs/benchmarks.md).
``torch.ops.fedflat.guided_point``, ``mix_norm`` and ``sam_point`` (``vector_ops.cpp``): FedWMSAM's perturbed point
``w + rho d/||d||``, ``d = (w^t - w) + k m_i``, in two passes over the flat vector instead of five ATen calls, the
momentum mix (FedCM, MoFedSAM, FedVSSAM, FedWMSAM) with the mix's norms in one, each with a rounding its source
defines (AVX2 and FMA registers where the CPU has them, scalar loops elsewhere: the same bits on every CPU, and those
of ATen's AVX2 and AVX-512 kernels), SAM's perturbed point from ATen's norm in one pass instead of three, and the
local loop's ``W + eps`` (``point_sum``; these two with ATen's bits on every level, several times faster than its
default level's loops); the parts reach them through :func:`fedflat.core.vectors.kernel` (:func:`operator`).
``torch.ops.fedflat.remove_low_band`` (``low_band.cpp``): FedFFT's pruned four-step band removal of one long tensor
(``fedflat.algorithms.fedfft.remove_low_band``), its column transforms 8 columns to a vector, the same bits on every
x86 CPU. ``relu_max_pool2`` and ``max_pool2_backward`` (``conv_ops.cpp``): the CNN's pooling for its hand-derived
gradient (:mod:`fedflat.engine.gradients.convnet`).

:func:`load` builds the library on first use (about 15 s; ``make`` does it at setup, ``python -m
fedflat.engine.native`` does it by hand) into ``$FEDFLAT_CACHE`` (default ``~/.cache/fedflat``) ``/native/<key>/``,
where the key hashes the source, torch's version and place and the compiler, so a new torch (or another
environment's) or an edited source builds anew. The build is written under a temporary name and renamed into place
under a file lock, then its SHA-256 beside it, so concurrent processes (Ray workers, parallel tests) build once, and
a library without a matching digest (half written, damaged) is built again rather than loaded (``dlopen`` of a
truncated library crashes the process). Where no compiler is found or the build fails, :func:`load` says why in one
``fedflat: warning:`` line on stderr (:func:`status` too) and returns None: the Python method runs instead, with the
same numbers. A failed build is recorded once per machine, ``build-failed.txt`` (the compiler's message) in the
key's folder, so later processes use the Python method at once, neither building again nor announcing a build;
``python -m fedflat.engine.native`` forgets the failure and tries again. ``FEDFLAT_NATIVE=0`` turns the native path
off.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

from fedflat.core.vectors import provide_kernels

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("mlp_gradient.cpp", "vector_ops.cpp", "low_band.cpp", "conv_ops.cpp"))
# -ffp-contract=off: no product and sum fused where the source does not write std::fma (vector_ops.cpp rounds as ATen)
FLAGS = ("-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared")
BUILD_SECONDS = 600  # a build that takes longer is stopped (and the Python path used)

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "op": the operator or None; "path": where it was loaded from; "reason": why None


def enabled() -> bool:
    """Whether the native path may be used (``FEDFLAT_NATIVE`` unset, or anything but ``0``/``off``/``false``)."""
    return os.environ.get("FEDFLAT_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++`` or ``g++`` on the PATH (None: none found)."""
    name = os.environ.get("CXX")
    if name:
        return shutil.which(name)
    return shutil.which("c++") or shutil.which("g++")


def cache_dir() -> Path:
    """Where built libraries live: ``$FEDFLAT_CACHE/native`` (default ``~/.cache/fedflat/native``)."""
    root = os.environ.get("FEDFLAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fedflat")
    return Path(root) / "native"


def _torch_paths() -> tuple[list[str], str]:
    base = Path(torch.__file__).parent
    return [str(base / "include")], str(base / "lib")


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def library_path(cxx: str) -> Path:
    """The built library's path for this source, torch and compiler ``cxx``."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(source.read_text() for source in SOURCES), torch.__version__, str(Path(torch.__file__).parent), version,
                                    _abi_flag(), *FLAGS, sys.platform]).encode()).hexdigest()[:16]
    return cache_dir() / key / "libfedflat_native.so"


def digest_path(target: Path) -> Path:
    """The SHA-256 of a complete build, written after it: a library without a matching one is not loaded."""
    return target.with_name(target.name + ".sha256")


def intact(target: Path) -> bool:
    """Whether ``target`` is a whole build (its recorded SHA-256 matches): ``dlopen`` of a truncated library
    crashes the process instead of raising."""
    try:
        return digest_path(target).read_text().strip() == hashlib.sha256(target.read_bytes()).hexdigest()
    except OSError:
        return False


class BuildFailedBefore(RuntimeError):
    """The build of this key failed on this machine before (``build-failed.txt``): not tried, nor said, again."""


def failure_path(target: Path) -> Path:
    """The record of a failed build of ``target``'s key: the compiler's message."""
    return target.with_name("build-failed.txt")


def _failed_before(target: Path) -> BuildFailedBefore:
    return BuildFailedBefore(f"its build failed on this machine ({failure_path(target)}); `python -m "
                             "fedflat.engine.native` tries again")


def forget_failure() -> None:
    """Removes the record of a failed build (for this compiler, source and torch), so the next :func:`load` builds."""
    cxx = compiler()
    if cxx is not None:
        failure_path(library_path(cxx)).unlink(missing_ok=True)


def build(cxx: str, target: Path) -> Path:
    """Compiles :data:`SOURCES` into ``target`` unless an intact build is there (checked under a file lock, so
    concurrent processes build once), then records its SHA-256; raises ``RuntimeError`` with the compiler's message
    when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent processes: one builds, the others wait and find it
        if intact(target):
            return target
        if failure_path(target).is_file():  # another process failed while this one waited
            raise _failed_before(target)
        includes, lib = _torch_paths()
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
        os.close(fd)
        command = [cxx, *FLAGS, _abi_flag(), *(f"-I{i}" for i in includes), *map(str, SOURCES), "-o", tmp,
                   f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_SECONDS)
            if done.returncode:
                _record_failure(target, f"{' '.join(command)}\nexit status {done.returncode}\n{done.stderr}")
                first = next((line for line in done.stderr.splitlines() if "error" in line), "") or \
                    (done.stderr.strip().splitlines() or ["no message"])[0]
                raise RuntimeError(f"{Path(cxx).name} failed: {first.strip()[:200]} (its message: "
                                   f"{failure_path(target)})")
            digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
            os.replace(tmp, target)  # atomic: a reader sees the whole library or none
            with open(tmp, "w") as f:
                f.write(digest)
            os.replace(tmp, digest_path(target))  # last: only a whole library has a matching digest
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _record_failure(target: Path, text: str) -> None:
    """Writes ``build-failed.txt`` atomically (a reader sees the whole record or none)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, failure_path(target))


def _load_op() -> Callable:
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    target = library_path(cxx)
    if not intact(target):  # not built yet, or damaged (a disk that filled up, say): built (again)
        if failure_path(target).is_file():
            raise _failed_before(target)
        print(f"fedflat: building the native MLP gradient once (about 15 s) into {target.parent}", file=sys.stderr,
              flush=True)
        build(cxx, target)
    torch.ops.load_library(str(target))
    _loaded["path"] = target
    return torch.ops.fedflat.mlp_loss_grad.default


def load() -> Callable | None:
    """``torch.ops.fedflat.mlp_loss_grad`` (built if needed), or None where the native path is off or cannot be
    built (:func:`status` says why; a new failure is also said on stderr, once)."""
    if not enabled():
        return None
    with _lock:
        if "op" not in _loaded:
            try:
                _loaded["op"] = _load_op()
            except Exception as err:  # noqa: BLE001 - any failure falls back to the Python method
                reason = " ".join(str(err).split()) or type(err).__name__
                _loaded["op"], _loaded["reason"] = None, reason
                if not isinstance(err, BuildFailedBefore):  # (said by the process whose build failed)
                    print(f"fedflat: warning: the native MLP gradient is not available ({reason}); the Python "
                          "method runs instead, with the same numbers, slower", file=sys.stderr, flush=True)
        return _loaded["op"]  # type: ignore[return-value]


def status() -> str:
    """One line: whether the native operator is loaded, and from where or why not."""
    if not enabled():
        return "native MLP gradient: off (FEDFLAT_NATIVE=0)"
    if load() is None:
        return f"native MLP gradient: not available ({_loaded.get('reason')})"
    return f"native MLP gradient: loaded from {_loaded['path']}"


def operator(name: str) -> Callable | None:
    """``torch.ops.fedflat.<name>`` from the library :func:`load` builds and loads (``vector_ops.cpp``'s
    ``guided_point``, FedWMSAM's fused step), or None where the library is not available; what
    :func:`fedflat.core.vectors.kernel` hands the parts."""
    if load() is None:
        return None
    try:
        return getattr(torch.ops.fedflat, name).default
    except (AttributeError, RuntimeError):  # (a name the library does not define)
        return None


provide_kernels(operator)  # the parts reach the operators through fedflat.core, which imports nothing of the engine
