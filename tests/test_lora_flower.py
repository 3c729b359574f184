"""LoRA on Flower: what crosses the wire is the adapters (and the head), framed by Flower's array serialization, and
a simulation gives ``fedflat.run``'s numbers.

The model is test_lora's tiny ViT (4x4 inputs, patch 2, width 16, one block) with LoRA of rank 2 on ``attn.qkv`` and
``attn.proj`` and the head trained whole: 355 federated numbers against a frozen base of 3,363.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("peft")

import fedflat  # noqa: E402
from fedflat.engine.simulation import Simulation  # noqa: E402
from fedflat.flower import simulate  # noqa: E402

LORA = ("model=vit", "model.patch=2", "model.dim=16", "model.depth=1", "model.heads=2", "adapter.r=2",
        "rounds=2", "eval.every=1", "threads=1")
NOT_COMPARED = {"seconds", "eval_seconds", "train_seconds", "store", "wire_up_bytes", "wire_down_bytes"}


def npy_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of ``np.save`` of an array (what Flower's ``Array`` holds): NumPy's format 1.0 writes a 10-byte
    preamble (magic ``\\x93NUMPY``, version, header length) and the header ``{'descr': ..., 'fortran_order': False,
    'shape': ...}`` followed by ``21 - len(repr(shape[0]))`` spare spaces (room to grow the first axis in place) and
    a newline, padded with spaces to a multiple of 64 bytes (``ARRAY_ALIGN``, at least one space); then the data."""
    import numpy as np

    descr = np.lib.format.dtype_to_descr(np.dtype(torch.empty(0, dtype=dtype).numpy().dtype))
    header = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (21 - len(repr(shape[0])) if shape else 0)
    unpadded = 10 + len(header) + 1
    padded = unpadded + 64 - unpadded % 64
    return padded + int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()


def test_npy_bytes_is_what_flower_serializes():
    from flwr.app import Array

    for shape, dtype in (((4, 355), torch.float32), ((4,), torch.float32), ((355,), torch.float32),
                         ((1, 1919234), torch.float32), ((3, 7), torch.int64), ((), torch.float32)):
        assert len(Array(torch.zeros(shape, dtype=dtype).numpy()).data) == npy_bytes(shape, dtype), shape


@pytest.mark.slow  # a Flower simulation and two fedflat runs: ~40 s on 2 cores
def test_a_lora_round_on_flower_sends_the_adapters_and_gives_fedflat_runs_numbers(tiny, tmp_path):
    """Each node receives the broadcast adapters once (``w``: every lora_A, lora_B and the head, nothing of the
    base) and answers its clients' upload rows: per round, up = every sampled client's row of each upload entry,
    down = the adapters once per node, each array framed by NumPy's header (:func:`npy_bytes`), and nothing else.
    The run's numbers and final adapters are fedflat.run's, bit for bit."""
    cfg = tiny(*LORA)
    sim = Simulation(cfg)
    P = sim.num_parameters
    assert P == 2 * 16 * 2 + (48 + 16) * 2 + 3 * 16 + 3  # A and B of qkv and proj, the head: the adapters' size
    assert sum(p.numel() for p in sim.model.module.parameters() if not p.requires_grad) > 9 * P
    opened = sim.server.begin_round(0)
    upload = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state).upload  # what a client sends
    K = cfg.sampling.clients_per_round

    ours = fedflat.run(cfg, save=False, progress=False)
    theirs = simulate(cfg, supernodes=3, out=tmp_path, progress=False)
    assert len(ours.metrics) == len(theirs.metrics) == 2
    for a, b in zip(ours.metrics, theirs.metrics):
        for key in set(a) - NOT_COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["round"], key)
    assert torch.equal(ours.final_parameters, theirs.final_parameters)
    assert theirs.summary["base_hash"] == ours.summary["base_hash"] == sim.report.base_hash

    assert upload["model"].shape == (K, P)
    for line in theirs.metrics:
        data_up = sum(K * row.numel() * row.element_size() for row in (v[0] for v in upload.values()))
        # a node's reply: one array per entry, [C_node, ...]; C_node < 10, so every node's header is alike
        framing = sum(npy_bytes((1, *v.shape[1:]), v.dtype) - v[0].numel() * v.element_size() for v in upload.values())
        nodes = (line["wire_up_bytes"] - data_up) / framing
        assert nodes in (1, 2, 3)  # the nodes hosting the round's sampled clients, of 3
        assert line["wire_down_bytes"] == nodes * npy_bytes((P,), torch.float32)  # the adapters, once per node
        assert data_up == K * (4 * P + 4)  # the adapters and the loss's scalar: nothing else goes up
