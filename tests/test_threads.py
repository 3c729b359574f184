"""threads: auto never asks for more threads than this process's share of the cores, and takes one thread
for small per-step work; a run leaves the caller's torch thread count as it found it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fedflat
from fedflat.engine import threads as threads_module
from fedflat.engine.simulation import Simulation
from fedflat.engine.threads import SMALL_STEP_FLOPS, available_cores, choose_threads, set_core_share


@pytest.fixture
def share():
    yield set_core_share
    set_core_share(None)


def test_choose_threads_rule(share, monkeypatch):
    monkeypatch.setattr(threads_module, "available_cores", lambda: 8)
    assert choose_threads(3) == 3 and choose_threads(None) is None  # a number, or torch's own choice
    assert choose_threads("auto", SMALL_STEP_FLOPS / 2) == 1  # small steps: one thread
    assert choose_threads("auto", SMALL_STEP_FLOPS * 10) == 8  # big steps: every core this process has
    share(2)  # e.g. a sweep of 4 workers on 8 cores
    assert choose_threads("auto", SMALL_STEP_FLOPS * 10) == 2
    share(64)  # never more than the cores it may run on
    assert choose_threads("auto", SMALL_STEP_FLOPS * 10) == 8
    assert choose_threads("auto", SMALL_STEP_FLOPS * 10, cores=0.5) == 1  # a Ray worker with half a CPU


def test_auto_threads_follow_the_step_size(tiny, share):
    small = Simulation(tiny())  # an MLP on 4x4 inputs: a step of a few kFLOP
    assert small.step_flops < SMALL_STEP_FLOPS and small.threads == 1
    big = Simulation(tiny("data.options.shape=[3,32,32]", "model=cnn", "train.batch_size=50"))
    assert big.step_flops > SMALL_STEP_FLOPS and big.threads == available_cores()
    share(1)
    assert Simulation(tiny("data.options.shape=[3,32,32]", "model=cnn", "train.batch_size=50")).threads == 1


def test_a_run_restores_the_callers_thread_count(tiny):
    torch.set_num_threads(2)
    fedflat.run(tiny("threads=1", "rounds=1"), save=False, progress=False)
    assert torch.get_num_threads() == 2


def test_openmp_threads_wait_passively_unless_the_user_says_otherwise():
    code = "import fedflat, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == "ACTIVE"
