"""Datasets (readers of the standard on-disk formats), client partitions and batched augmentation.

>>> from fedflat.data import load_dataset, partition
>>> data = load_dataset("digits")
>>> parts = partition(data.y_train.numpy(), num_clients=10, scheme="dirichlet", seed=0, alpha=0.5)
"""

from .adapters import flwr_partitions
from .dataset import (AUGMENTATIONS, Dataset, DatasetError, Standardize, apply_augmentation, augmentation_fn,
                      cifar_augment, crop_flip, validation_split)
from .datasets import DATASETS, dataset_options, load_dataset, register_dataset
from .glue import load_glue  # registers the "glue" dataset
from .download import ChecksumError, DownloadError, download_file, file_checksum, verify_file
from .partition import (PARTITIONS, client_split, client_test_split, label_counts, partition, partition_params,
                        plot_partition, split_name, user_split)
from .sources import DatasetNotFoundError, cache_dir

__all__ = [
    "AUGMENTATIONS", "ChecksumError", "DATASETS", "Dataset", "DatasetError", "DatasetNotFoundError", "DownloadError",
    "PARTITIONS", "Standardize",
    "apply_augmentation", "augmentation_fn", "cache_dir", "cifar_augment", "client_split", "client_test_split",
    "crop_flip", "dataset_options", "download_file", "file_checksum", "flwr_partitions", "label_counts",
    "load_dataset", "load_glue", "partition", "partition_params", "plot_partition", "register_dataset", "split_name",
    "user_split", "validation_split", "verify_file",
]
