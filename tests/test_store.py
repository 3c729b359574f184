"""The client-state store: memory and disk tiers agree, snapshots, checkpoints, budgets, spilled runs."""
from __future__ import annotations

import pytest
import torch

import fedflat
from fedflat.engine.simulation import Simulation
from fedflat.engine.store import ClientStore

P = 7


def _vectors(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, P, generator=torch.Generator().manual_seed(seed))


def _fill(store: ClientStore) -> dict[tuple[str, int], torch.Tensor]:
    """Writes, then overwrites some clients; returns what each (name, client) should hold."""
    expected = {}
    first, second = _vectors(4, 0), _vectors(3, 1)
    store.put("c_i", torch.tensor([5, 1, 9, 3]), first)
    store.put("h_i", torch.tensor([2, 5, 7]), second)
    store.put("c_i", torch.tensor([9, 4]), 10 * first[:2])  # 9 overwritten, 4 new
    for row, key in enumerate([5, 1, 9, 3]):
        expected["c_i", key] = first[row]
    for row, key in enumerate([2, 5, 7]):
        expected["h_i", key] = second[row]
    expected["c_i", 9], expected["c_i", 4] = 10 * first[0], 10 * first[1]
    return expected


def _check(store: ClientStore, expected: dict[tuple[str, int], torch.Tensor]) -> None:
    for name in ("c_i", "h_i"):
        ids = torch.tensor([4, 0, 9, 5, 3, 2, 1, 7])
        values, present = store.get(name, ids)
        for row, key in enumerate(ids.tolist()):
            if (name, key) in expected:
                assert present[row]
                torch.testing.assert_close(values[row], expected[name, key], rtol=0, atol=0)
            else:
                assert not present[row] and not values[row].any()


@pytest.mark.parametrize("memory_mb", [None, 0, 3 * P * 4 / 2 ** 20])
def test_memory_and_disk_tiers_return_what_was_written(memory_mb):
    """All in RAM, all on disk, and a budget of exactly three vectors give identical reads."""
    store = ClientStore(P, memory_mb=memory_mb)
    expected = _fill(store)
    _check(store, expected)
    assert store.count() == 8 and store.count("c_i") == 5 and store.count("h_i") == 3
    in_memory = {None: 8, 0: 0}.get(memory_mb, 3)
    assert store.spilled() == 8 - in_memory
    assert store.memory_bytes == in_memory * P * 4 and store.disk_bytes == (8 - in_memory) * P * 4
    store.close()


def test_spill_file_grows_beyond_its_first_capacity():
    store = ClientStore(P, memory_mb=0)
    values = _vectors(40, 2)
    store.put("x", torch.arange(40), values)
    got, present = store.get("x", torch.arange(40).flip(0))
    assert present.all()
    torch.testing.assert_close(got, values.flip(0), rtol=0, atol=0)
    store.close()


def test_state_dict_is_a_snapshot_and_loads_into_any_budget(tmp_path):
    store = ClientStore(P, memory_mb=2 * P * 4 / 2 ** 20, directory=tmp_path / "spill")
    expected = _fill(store)
    state = store.state_dict()
    assert store.spilled() > 0 and sum(len(s) for s in state.values()) == 8
    store.put("c_i", torch.tensor([9, 1]), torch.full((2, P), -1.0))  # one spilled, one in memory
    for (name, key), vector in expected.items():
        torch.testing.assert_close(state[name][key], vector, rtol=0, atol=0)
    torch.save(state, tmp_path / "ckpt.pt")
    for memory_mb in (None, 0):
        other = ClientStore(P, memory_mb=memory_mb)
        other.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
        _check(other, expected)
        other.close()
    store.close()


def test_spill_folder_lives_under_the_given_directory_and_is_removed_on_close(tmp_path):
    store = ClientStore(P, memory_mb=0, directory=tmp_path)
    store.put("c_i", torch.tensor([0]), _vectors(1, 3))
    (folder,) = tmp_path.iterdir()
    assert any(folder.iterdir())
    store.close()
    assert not folder.exists()


def test_never_spilling_store_creates_no_folder(tmp_path):
    store = ClientStore(P, memory_mb=1, directory=tmp_path / "spill")
    store.put("c_i", torch.tensor([0, 1]), _vectors(2, 4))
    assert not (tmp_path / "spill").exists()


def test_bad_shapes_and_budgets_are_clear_errors():
    store = ClientStore(P)
    with pytest.raises(ValueError, match=r"expected values of shape \(2, 7\)"):
        store.put("c_i", torch.tensor([0, 1]), torch.zeros(2, P + 1))
    with pytest.raises(ValueError, match="budget"):
        ClientStore(P, memory_mb=-1)
    with pytest.raises(ValueError, match="shape"):
        store.load_state_dict({"c_i": {0: torch.zeros(3)}})


def _timing_free(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if "seconds" not in k} for m in metrics]


@pytest.mark.parametrize("vectors_in_memory", [0, 2])
def test_run_with_spilled_state_equals_in_memory_run(tiny, tmp_path, vectors_in_memory):
    """SCAFFOLD on the tiny problem: c_i all on disk, or split between memory and disk, changes nothing."""
    reference = fedflat.run(tiny("algo=scaffold", "rounds=4"), save=False, progress=False)
    P = reference.final_parameters.numel()
    overrides = ("algo=scaffold", "rounds=4", f"store.memory_mb={vectors_in_memory * P * 4 / 2 ** 20}",
                 f"store.dir={tmp_path}")
    spilled = fedflat.run(tiny(*overrides), save=False, progress=False)
    assert _timing_free(spilled.metrics) == _timing_free(reference.metrics)
    torch.testing.assert_close(spilled.final_parameters, reference.final_parameters, rtol=0, atol=0)
    sim = Simulation(tiny(*overrides))
    for t in range(4):
        sim.run_round(t)
    assert sim.server.store.count() == reference.metrics[-1]["store"] > vectors_in_memory
    assert sim.server.store.spilled() == sim.server.store.count() - vectors_in_memory


def test_resume_from_a_spilled_store_equals_uninterrupted(tiny, tmp_path):
    cfg = tiny("algo=feddyn", "rounds=4", "store.memory_mb=0")
    whole = Simulation(cfg)
    for t in range(4):
        whole.run_round(t)
    first = Simulation(cfg)
    for t in range(2):
        first.run_round(t)
    state = first.server.state_dict()
    first.run_round(2)  # overwrites spilled h_i: the state taken before must not follow
    torch.save(state, tmp_path / "state.pt")
    second = Simulation(tiny("algo=feddyn", "rounds=4"))  # all in memory this time
    second.server.load_state_dict(torch.load(tmp_path / "state.pt"))
    for t in range(2, 4):
        second.run_round(t)
    torch.testing.assert_close(second.server.w, whole.server.w, rtol=0, atol=0)
    ids = torch.arange(6)
    torch.testing.assert_close(second.server.store.get("dyn.h_i", ids), whole.server.store.get("dyn.h_i", ids),
                               rtol=0, atol=0)
