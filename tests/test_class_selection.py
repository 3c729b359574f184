"""``data.options.classes``: a task made of some classes of a dataset, every dataset's option (load_dataset)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import fedflat
from fedflat.config import as_config
from fedflat.core import ConfigError
from fedflat.data import Dataset, DatasetError, Standardize, load_dataset, register_dataset
from fedflat.data.dataset import select_classes
from fedflat.engine.simulation import Simulation

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
DOMAINS = {"shape": (1, 4, 4), "num_classes": 5, "train_size": 100, "test_size": 40, "domains": 3}


def test_selected_classes_are_relabelled_in_the_order_given():
    """Class classes[j] becomes label j; the rows are the original rows of those classes, in their order, with their
    owners (the synthetic data's domains); the inputs are the same values (not standardized again)."""
    full = load_dataset("synthetic", **DOMAINS)
    part = load_dataset("synthetic", **DOMAINS, classes=[3, 0])
    assert part.num_classes == 2
    for split in ("train", "test"):
        y = getattr(full, f"y_{split}").numpy()
        rows = np.flatnonzero((y == 3) | (y == 0))  # by hand: the rows of classes 3 and 0, in order
        assert torch.equal(getattr(part, f"x_{split}"), getattr(full, f"x_{split}")[rows])
        assert getattr(part, f"y_{split}").tolist() == [0 if c == 3 else 1 for c in y[rows]]
    assert np.array_equal(part.owners, full.owners[np.flatnonzero(np.isin(full.y_train.numpy(), [3, 0]))])
    assert part.owner_names == full.owner_names and part.x_train.dtype == torch.float32


def test_uint8_images_stay_uint8_with_their_standardization():
    x = torch.arange(6 * 2 * 2, dtype=torch.uint8).view(6, 1, 2, 2)
    data = Dataset("u8", x, torch.tensor([0, 1, 2, 0, 1, 2]), x[:3], torch.tensor([2, 1, 0]), 3,
                   standardize=Standardize((0.5,), (0.25,)))
    part = select_classes(data, [2, 1])
    assert part.x_train.dtype == torch.uint8 and part.standardize == data.standardize
    assert torch.equal(part.x_train, x[[1, 2, 4, 5]]) and part.y_train.tolist() == [1, 0, 1, 0]
    assert torch.equal(part.x_test, x[[0, 1]]) and part.y_test.tolist() == [0, 1]


@pytest.mark.parametrize("classes,message", [
    ([0, 7], r"data.options.classes: 'synthetic' has classes 0..4, not 7; choose among those"),
    ([1, 1, 2], r"lists class 1 more than once"),
    ([3], r"a list of at least two class ids"),
    ([0, -1], r"integers >= 0"),
    ("0,1", r"a list of at least two class ids"),
    ([True, 2], r"a list of at least two class ids"),
])
def test_a_bad_selection_is_refused_in_one_line(classes, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset("synthetic", **DOMAINS, classes=classes)


def test_the_config_checks_the_list_before_any_data_is_read(tiny):
    with pytest.raises(ConfigError, match="lists class 2 more than once"):
        as_config(tiny("data.options.classes=[2,2]"))
    with pytest.raises(ConfigError, match=r"data.options.class: unknown option \(did you mean 'classes'\?\)"):
        as_config(tiny("data.options.class=[0,1]"))
    as_config(tiny("data.options.classes=[2,0]"))


def test_a_run_trains_on_the_selected_task(tiny):
    """The model's head has one output a selected class; the test set holds only those classes."""
    sim = Simulation(tiny("data.options.classes=[2,0]"))
    assert sim.dataset.num_classes == 2 and set(sim.dataset.y_test.tolist()) == {0, 1}
    history = fedflat.run(tiny("data.options.classes=[2,0]", "rounds=1"), save=False, progress=False)
    assert history.final_parameters.numel() == 16 * 8 + 8 + 8 * 2 + 2  # MLP 16-8-2


def test_a_loader_of_ones_own_may_not_take_classes():
    def loader(root=None, download=False, classes=None):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="rename the parameter"):
        register_dataset("mine_with_classes", loader, "a loader that takes classes")


@pytest.mark.skipif(not DEBIAN_FMNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnists_other_five_classes():
    data = load_dataset("fmnist", classes=[5, 6, 7, 8, 9])
    assert data.num_classes == 5 and len(data.y_train) == 30000 and len(data.y_test) == 5000
    assert np.array_equal(np.bincount(data.y_train.numpy()), np.full(5, 6000))
