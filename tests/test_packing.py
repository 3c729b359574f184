"""``fedflat sweep --workers auto`` (fedflat/experiments/packing.py): how many cells run at once, measured.

On a GPU the first cell runs alone for a round and writes its footprint; the sweep then starts as many cells as the
memory left holds, at most one a core. The decision's arithmetic is checked on numbers computed by hand; the footprint
a real cell writes, on a GPU (``pytest --device cuda``)."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from fedflat.experiments.packing import FOOTPRINT_FILE, HEADROOM, RESERVE, Footprint, Packing, cells_that_fit

GIB = 2 ** 30


def test_cells_that_fit_leave_the_reserve_and_the_headroom():
    # 80 GiB card, the first cell holds 2 GiB and 60 GiB are free: (60 - 0.05 * 80) / (1.25 * 2) = 56 / 2.5 = 22.4
    assert (RESERVE, HEADROOM) == (0.05, 1.25)
    assert cells_that_fit(60 * GIB, 80 * GIB, 2 * GIB) == 22
    assert cells_that_fit(3 * GIB, 80 * GIB, 2 * GIB) == 0  # less free than the reserve: none beside it
    assert cells_that_fit(int(6.5 * GIB), 80 * GIB, 2 * GIB) == 1  # (6.5 - 4) / 2.5 = 1.0


def _footprint(folder, used, free, total) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"used_bytes": used, "free_bytes": free, "total_bytes": total, "peak_reserved_bytes": used, "round": 1}
    (folder / FOOTPRINT_FILE).write_text(json.dumps(record))


def test_on_a_gpu_one_cell_runs_until_its_footprint_then_as_many_as_fit(tmp_path):
    packing = Packing.of(["cuda"] * 40, cores=16, since=time.time() - 1)
    first = tmp_path / "cell0"
    assert packing.gpu and packing.workers([first]) == 1  # no footprint yet: the first cell alone
    _footprint(first, used=2 * GIB, free=60 * GIB, total=80 * GIB)
    assert packing.workers([first]) == 16  # 1 + 22 fit, 16 cores: one cell a core
    assert "16 cell(s) at once on the GPU" in packing.reason and "room for 23" in packing.reason
    assert packing.threads == 1

    few = Packing.of(["cuda"] * 5, cores=16, since=time.time() - 1)
    _footprint(tmp_path / "a", used=20 * GIB, free=50 * GIB, total=80 * GIB)  # (50 - 4) / 25 = 1.84: one more
    assert few.workers([tmp_path / "a"]) == 2
    assert few.threads == 3  # 16 cores over the 5 cells that might run at once


def test_an_earlier_sweeps_footprint_is_not_this_machines_measurement(tmp_path):
    folder = tmp_path / "cell0"
    _footprint(folder, used=GIB, free=70 * GIB, total=80 * GIB)
    old = time.time() - 3600
    os.utime(folder / FOOTPRINT_FILE, (old, old))
    assert Packing.of(["cuda"] * 8, cores=8, since=time.time() - 1).workers([folder]) == 1


def test_on_cpu_auto_runs_one_cell_a_core():
    packing = Packing.of(["cpu"] * 5, cores=2)
    assert not packing.gpu and packing.workers([]) == 2 and packing.threads == 1
    assert Packing.of(["cpu"], cores=4).workers([]) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cell_on_a_gpu_writes_its_footprint_after_its_first_round(tiny, tmp_path):
    import fedflat

    fedflat.run(tiny("device=cuda", "rounds=2"), save=False, progress=False, callbacks=[Footprint(tmp_path)])
    record = json.loads((tmp_path / FOOTPRINT_FILE).read_text())
    free, total = torch.cuda.mem_get_info()
    assert record["round"] == 1 and record["total_bytes"] == total  # (callbacks number rounds from 1)
    assert record["used_bytes"] >= record["peak_reserved_bytes"] > 0  # the context besides the allocator's blocks
    assert record["used_bytes"] + record["free_bytes"] == total


def test_the_command_line_takes_auto_workers_and_refuses_nonsense(tmp_path, capsys):
    from test_sweep import write_sweep

    from fedflat.cli import main

    path = write_sweep(tmp_path, {"overrides": ["rounds=1"], "grid": {"seed": [0, 1]}})
    assert main(["sweep", str(path), "--workers", "auto", "--dry-run"]) == 0
    assert "2 cells" in capsys.readouterr().out
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            main(["sweep", str(path), "--workers", bad])
        assert "or auto (as many cells as fit)" in capsys.readouterr().err


class _FirstRoundDecides(Packing):
    """A GPU's packing, on the CPU: the first cell's first metrics line stands in for its footprint (two fit)."""

    decided_at = None

    def workers(self, folders):
        if self.limit is None and any((f / "metrics.jsonl").exists() for f in folders):
            self.limit, self.reason, self.decided_at = 2, "2 cell(s) at once (the test's footprint)", time.time()
        return self.limit or 1


def test_packed_cells_start_warm_and_wait_to_be_let_in(tmp_path, monkeypatch):
    """Packing on a GPU, the cells' processes start at once (one a core) while the first cell measures its footprint;
    the others import and wait, and begin their runs (their config.yaml) only once the decision lets them in. Every
    cell completes, with the models of the same cells run one at a time."""
    from test_sweep import write_sweep

    from fedflat.experiments import cells as cells_module
    from fedflat.experiments.sweep import load_sweep, run_sweep

    packing = _FirstRoundDecides(cores=2, cells=3, gpu=True)
    monkeypatch.setattr(cells_module.Packing, "of", classmethod(lambda cls, devices, cores, since=0.0: packing))
    starts = []
    start = cells_module._start_deaf_to_ctrl_c
    monkeypatch.setattr(cells_module, "_start_deaf_to_ctrl_c", lambda p: (starts.append(time.time()), start(p)))
    path = write_sweep(tmp_path, {"overrides": ["rounds=2"], "grid": {"seed": [0, 1, 2]}})
    packed = run_sweep(load_sweep(path), workers="auto", progress=False).cells
    assert [c["status"] for c in packed] == ["completed"] * 3
    assert packing.decided_at is not None and sum(t < packing.decided_at for t in starts) == 2  # two warm at once
    for cell in packed[1:]:  # let in by the decision, not before
        assert (tmp_path / "out" / cell["name"] / "config.yaml").stat().st_mtime >= packing.decided_at
    (tmp_path / "alone").mkdir()
    alone = run_sweep(load_sweep(write_sweep(tmp_path / "alone", {"overrides": ["rounds=2"], "grid": {"seed": [0, 1, 2]}})),
                      workers=1, progress=False).cells
    assert [c["final_test_acc"] for c in packed] == [c["final_test_acc"] for c in alone]


def test_warm_processes_one_a_core_while_measuring_then_one_spare_a_running_cell(tmp_path):
    packing = Packing.of(["cuda"] * 40, cores=16, since=time.time() - 1)
    assert packing.alive(packing.workers([tmp_path / "cell0"])) == 16  # 1 measuring, 15 waiting
    packing.limit = 3  # (as decided from a footprint)
    assert packing.alive(3) == 6  # 3 running, 3 waiting to follow them
    packing.limit = 12
    assert packing.alive(12) == 16  # never more than a core each


def test_cells_side_by_side_start_longest_first(tmp_path):
    """Longest processing time first: a cell's work is its rounds left x clients a round x local steps x backward
    passes a step (FedSAM's two), so FedSAM's 3 rounds (6 units) go before its 2 (4), then FedAvg's 3 (3) and 2 (2);
    a cell with 2 of its 3 rounds done has 1 left (2 units, FedSAM), tied with FedAvg's 2 rounds, and ties keep the
    sweep's order."""
    from test_sweep import write_sweep

    from fedflat.experiments.cells import longest_first
    from fedflat.experiments.sweep import load_sweep

    path = write_sweep(tmp_path, {"grid": {"method": {"fedavg": {"algo": "fedavg"}, "fedsam": {"algo": "fedsam"}},
                                           "rounds": [2, 3]}})
    cells = load_sweep(path).cells()
    assert [c.name for c in cells] == ["fedavg__rounds2", "fedavg__rounds3", "fedsam__rounds2", "fedsam__rounds3"]
    out = tmp_path / "out"
    assert [c.name for c in longest_first(cells, out)] == ["fedsam__rounds3", "fedsam__rounds2", "fedavg__rounds3",
                                                           "fedavg__rounds2"]
    (out / "fedsam__rounds3").mkdir(parents=True)
    (out / "fedsam__rounds3" / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    assert [c.name for c in longest_first(cells, out)] == ["fedsam__rounds2", "fedavg__rounds3", "fedavg__rounds2",
                                                           "fedsam__rounds3"]
    for garbage in ("{not json\n", '["round"]\n', '{"round": "x"}\n'):  # an unreadable folder orders as a fresh one
        (out / "fedsam__rounds3" / "metrics.jsonl").write_text(garbage)
        assert longest_first(cells, out)[0].name == "fedsam__rounds3"
