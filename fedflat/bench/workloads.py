"""The standard benchmark workloads (W1-W6 and a test-sized one) and the engines a bench compares.

W5 and W6 fine-tune a frozen transformer base with LoRA (the ``adapter`` section): W5 a small RoBERTa-shaped text
model, a CPU round of seconds; W6 ViT-B/16 on 224x224 images, the GPU's. Their bases have random weights (only speed
is measured): W5's is a Hugging Face model built from a ``config.json`` the bench writes (:func:`prepare`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("sequential", "vectorized", "streams", "bare", "plain")


@dataclass(frozen=True)
class Workload:
    """A standard benchmark setting: a config tree and how many rounds a CPU run should time."""

    name: str
    description: str
    tree: dict[str, Any]
    cpu_rounds: int | None = None  # cap on timed rounds on CPU (W3: one)
    cpu_warmup: int | None = None
    cpu_overrides: tuple[str, ...] = ()  # what a CPU run changes besides (W6: fewer clients and steps)
    hf_config: dict[str, Any] = field(default_factory=dict)  # a transformers config.json for model=hf (random weights)


def prepare(workload: Workload, folder: str | Path) -> list[str]:
    """The overrides that make ``workload`` runnable: for a workload of a Hugging Face model, its ``config.json``
    written into ``folder`` and ``model.path`` pointing there (transformers fills what the file leaves out with
    the model type's defaults); none for the others."""
    if not workload.hf_config:
        return []
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(workload.hf_config, indent=2))
    return [f"model.path={folder}"]


def _tree(shape: list[int], train_size: int, num_clients: int, partition: dict, model: dict, per_round: int,
          epochs: int, batch: int, test_size: int = 1000, adapter: dict | None = None,
          **options: Any) -> dict[str, Any]:
    return {"seed": 0, "rounds": 1000,
            "data": {"name": "synthetic", "num_clients": num_clients, "partition": partition,
                     "options": {"shape": shape, "num_classes": 10, "train_size": train_size, "test_size": test_size,
                                 **options}},
            "model": model, "sampling": {"clients_per_round": per_round}, **({"adapter": adapter} if adapter else {}),
            "train": {"local_epochs": epochs, "batch_size": batch}, "eval": {"batch_size": min(test_size, 1000)}}


#: RoBERTa's config.json keys that differ from transformers' defaults of a "roberta" model (the sizes are set beside
#: it: W5's below)
ROBERTA = {"model_type": "roberta", "architectures": ["RobertaForSequenceClassification"], "type_vocab_size": 1,
           "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
#: RoBERTa-base's shape (roberta-base's config.json): 12 layers of width 768, 12 heads, FFN 3072, 50,265 tokens
ROBERTA_BASE = ROBERTA | {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                          "intermediate_size": 3072, "vocab_size": 50265, "max_position_embeddings": 514}

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("W1", "Fashion-MNIST-shaped, MLP 784-200-200-10, 100 clients Dirichlet 0.1, 10/round, 5 epochs, batch 50",
             _tree([1, 28, 28], 60000, 100, {"scheme": "dirichlet", "alpha": 0.1, "min_size": 10},
                   {"name": "mlp"}, 10, 5, 50)),
    Workload("W2", "CIFAR-10-shaped, cnn, 1,000 clients x 50 samples, 50/round, 1 epoch, batch 10",
             _tree([3, 32, 32], 50000, 1000, {"scheme": "iid"}, {"name": "cnn"}, 50, 1, 10)),
    Workload("W3", "CIFAR-10-shaped, ResNet-18-GN, 10 clients x 500 samples, 10/round, 5 epochs, batch 50",
             _tree([3, 32, 32], 5000, 10, {"scheme": "iid"}, {"name": "resnet18"}, 10, 5, 50),
             cpu_rounds=1, cpu_warmup=0),
    Workload("W4", "CIFAR-10-shaped, ResNet-20-GN, 500 clients x 100 samples, 10/round, 1 epoch, batch 50",
             _tree([3, 32, 32], 50000, 500, {"scheme": "iid"}, {"name": "resnet20"}, 10, 1, 50)),
    Workload("W5", "RoBERTa-shaped text model (hidden 256, 4 layers, 4 heads, FFN 1024, random weights), 64 token ids, "
                   "LoRA r=8 on query/value + head; 100 clients x 32 samples, 10/round, 1 epoch, batch 16",
             _tree([64], 3200, 100, {"scheme": "iid"}, {"name": "hf", "random_weights": True}, 10, 1, 16,
                   test_size=200, adapter={"r": 8, "target_modules": ["query", "value"]}, tokens=5000),
             hf_config=ROBERTA | {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "intermediate_size": 1024, "vocab_size": 5000, "max_position_embeddings": 66}),
    Workload("W6", "ViT-B/16 (random weights) on 224x224 images, LoRA r=8 on attn.qkv/attn.proj + head; 10 clients "
                   "x 64 samples, 10/round, 1 epoch, batch 32 (CPU: 1 round of 2 clients x 1 step of 8 images)",
             _tree([3, 224, 224], 640, 10, {"scheme": "iid"}, {"name": "vit", "variant": "base16"}, 10, 1, 32,
                   test_size=100, adapter={"r": 8}),
             cpu_rounds=1, cpu_warmup=0,
             cpu_overrides=("data.options.train_size=160", "data.options.test_size=20", "sampling.clients_per_round=2",
                            "train.local_steps=1", "train.batch_size=8")),
    Workload("tiny", "test-sized: 4x4 inputs, MLP hidden 8, 6 clients, 3/round, 1 epoch, batch 10",
             {"seed": 0, "rounds": 1000,
              "data": {"name": "synthetic", "num_clients": 6, "partition": {"scheme": "iid"},
                       "options": {"shape": [1, 4, 4], "num_classes": 3, "train_size": 180, "test_size": 60}},
              "model": {"name": "mlp", "hidden": [8]}, "sampling": {"clients_per_round": 3},
              "train": {"local_epochs": 1, "batch_size": 10}}),
)}
