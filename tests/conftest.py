"""Shared fixtures: tiny synthetic configs that train in well under a second."""
from __future__ import annotations

import os

import pytest
import torch

from fedflat.config import DEVICE_ENV, load_config
from fedflat.core.contract import CHECK_ENV

# Every part's every hook is watched for in-place changes of tensors it does not own (the contract's rule 1), in
# this process and in the workers it starts (sweep workers, Ray workers, Flower nodes inherit the environment).
os.environ.setdefault(CHECK_ENV, "1")


def pytest_addoption(parser):
    parser.addoption("--device", default=None,
                     help="device of every config that names none (cpu, cuda): `pytest --device cuda` runs the "
                          "device-independent tests on a GPU")
    parser.addoption("--shape-rounding", action="store_true",
                     help="run every test on a CPU whose matrix products round by their shapes (tests/rounding.py): "
                          "an equality that holds only as this CPU's BLAS rounds fails")


def pytest_configure(config):
    device = config.getoption("--device")
    if device:
        os.environ[DEVICE_ENV] = device


def tiny_tree(**extra) -> dict:
    """A tiny federated problem: synthetic 1x4x4 data, 6 clients, an MLP with one small layer."""
    tree = {
        "seed": 0, "rounds": 3,
        "data": {"name": "synthetic", "num_clients": 6,
                 "options": {"shape": [1, 4, 4], "num_classes": 3, "train_size": 180, "test_size": 60},
                 "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}},
        "model": {"name": "mlp", "hidden": [8]},
        "algo": {"name": "fedavg"},
        "train": {"local_epochs": 1, "batch_size": 10, "lr": 0.1},
        "sampling": {"clients_per_round": 3},
    }
    for key, value in extra.items():
        node = tree
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose memory map holds ``tensor``'s data (Linux's /proc/self/maps), or None: data paged from
    disk, not copied into memory."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            lo, hi = (int(a, 16) for a in span.split("-"))
            if lo <= address < hi:
                return rest[4] if len(rest) > 4 and rest[4].startswith("/") else None
    return None


# The tiny problem's model for a method that keeps BatchNorm layers on the clients (FedBN): the CNN with BatchNorm
# on 8x8 synthetic images.
BATCH_NORM_CNN = ("model=cnn", "model.padding=2", "model.norm=batch", "data.options.shape=[1,8,8]")
# ... with dropout too: the model of the tests that every engine and executor trains buffers and masks alike
BN_DROPOUT_CNN = (*BATCH_NORM_CNN, "model.dropout=0.3")


# The tiny MLP with LoRA adapters on its hidden layer (and its head trained whole): a recipe of adapters' model
MLP_LORA = ("adapter.r=2", "adapter.target_modules=[body.0]")


def model_for(recipe: str) -> tuple[str, ...]:
    """Overrides that give ``recipe`` a model it runs on: none (the tiny MLP), :data:`BATCH_NORM_CNN` for a
    recipe whose personalization keeps BatchNorm layers (which the MLP has not), :data:`MLP_LORA` for a recipe of
    low-rank adapters (FFA-LoRA, FedSA-LoRA)."""
    from fedflat.algorithms import RECIPES

    recipe = RECIPES[recipe]
    return BATCH_NORM_CNN if recipe.personalization == "fedbn" else MLP_LORA if recipe.adapter else ()


def tiny_config(*overrides: str):
    """The :class:`Config` of the tiny problem with ``overrides``."""
    return load_config(None, list(overrides), base=tiny_tree())


@pytest.fixture
def tiny():
    """``tiny(overrides...) -> Config`` of the tiny problem."""
    return tiny_config


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _shape_rounding(request, monkeypatch):
    """``pytest --shape-rounding``: the test runs under :class:`rounding.ShapeRounding`, in every thread it starts
    too (a dispatch mode is a thread's own)."""
    if not request.config.getoption("--shape-rounding"):
        yield
        return
    import threading

    from rounding import ShapeRounding

    cpu, run = ShapeRounding(), threading.Thread.run

    def run_under_it(thread):
        with cpu:
            run(thread)

    monkeypatch.setattr(threading.Thread, "run", run_under_it)
    with cpu:
        yield
