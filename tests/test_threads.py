"""threads: auto never asks for more threads than this process's share of the cores, and takes one thread
for small per-step work; a run leaves the caller's torch thread count as it found it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fedflat
from fedflat.engine import cores
from fedflat.engine.cores import SMALL_STEP_FLOPS, available_cores, choose_threads, set_core_share
from fedflat.engine.simulation import Simulation


@pytest.fixture
def share():
    yield set_core_share
    set_core_share(None)


def test_choose_threads_rule(share, monkeypatch):
    monkeypatch.setattr(cores, "available_cores", lambda: 8)
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
    assert small.report.step_flops < SMALL_STEP_FLOPS and small.report.threads == 1
    big = Simulation(tiny("data.options.shape=[3,32,32]", "model=cnn", "train.batch_size=50"))
    assert big.report.step_flops > SMALL_STEP_FLOPS and big.report.threads == available_cores()
    share(1)
    assert Simulation(tiny("data.options.shape=[3,32,32]", "model=cnn", "train.batch_size=50")).report.threads == 1


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


def test_a_runs_data_do_not_depend_on_the_thread_count(tiny):
    """The data are standardized on one thread (issue 32): a long mean and std summed by two threads round
    differently, and `fedflat run` on Fashion-MNIST (the process's default threads while the data load) trained
    on other bits than its Flower simulation's nodes (one thread each)."""
    cfg = tiny("data.options.shape=[1,28,28]", "data.options.train_size=2000")
    data = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        data[threads] = Simulation(cfg).dataset
    assert torch.equal(data[2].x_train, data[1].x_train) and torch.equal(data[2].x_test, data[1].x_test)
