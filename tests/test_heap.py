"""A run's process keeps the memory a step freed (glibc's thresholds, fedflat/engine/cores.py): the next step's large
tensors reuse it instead of pages the kernel zero-fills, and FEDFLAT_MALLOC=default leaves glibc as it is."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"

# A 64 MiB tensor (above glibc's largest dynamic mmap threshold, 32 MiB) allocated, filled and freed, then a 60 MiB
# one: its page faults. glibc's own settings map it afresh (15,360 pages faulted in); kept, the freed block serves
# it. (Not 64 MiB again: PyTorch allocates with posix_memalign, which asks a little more than the block it freed.)
PROBE = """
import resource, torch
from fedflat.engine.cores import retain_freed_memory
print(retain_freed_memory())
x = torch.ones(1 << 24); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(15 << 20); del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_a_freed_large_tensor_is_reused_without_page_faults():
    kept, faults = _probe({})
    assert kept == "True" and faults < 1000  # 15,360 pages when freshly mapped
    default, faults_default = _probe({"FEDFLAT_MALLOC": "default"})
    assert default == "False" and faults_default >= (15 << 22) // os.sysconf("SC_PAGE_SIZE") // 2


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_a_run_sets_it_in_its_process_and_its_workers():
    """A Simulation (the driver's, a Flower node's, a sweep cell's) and a Ray worker's runtime set it once."""
    code = """
from fedflat.engine import cores
from fedflat.engine.simulation import Simulation
from fedflat.engine.ray_executor import build_runtime
from tests.conftest import tiny_config
before = list(cores._DONE)
sim = Simulation(tiny_config())
after_driver = list(cores._DONE)
cores._DONE.clear()
build_runtime(sim.worker_spec(), sim.worker_data())
print(before, after_driver, cores._DONE)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)), env={k: v for k, v in os.environ.items()
                                                                             if k != "FEDFLAT_MALLOC"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] [True] [True]"
