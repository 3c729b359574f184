"""Reliability under load and faults (issue 11): one writer per run folder, disk full, SIGTERM, permissions,
output folders checked before any data are loaded, and a fast `--help`."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fedflat
from fedflat.cli import main
from fedflat.engine.checkpoint import read_checkpoint
from fedflat.experiments.resume import metrics_equal, resume
from fedflat.experiments.rundir import RunFolderBusy
from fedflat.experiments.sweep import run_cell
from fedflat.files import read_jsonl

REPO = Path(__file__).resolve().parents[1]
# The command line as a subprocess: the module, so the tests need fedflat importable from the repository, not its
# console script installed next to this Python (the GPU machine could not build it offline).
CLI = [sys.executable, "-m", "fedflat.cli"]
CLI_SHELL = " ".join(shlex.quote(part) for part in CLI)


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that holds the run folder (as a live run does) until it is killed."""
    code = ("import sys, time; from fedflat.experiments.rundir import hold\n"
            "with hold(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_folder_refuses_a_second_writer(tiny, tmp_path):
    folder = tmp_path / "run"
    fedflat.run(tiny("rounds=4", "checkpoint_every=2"), run_dir=folder, progress=False)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".lock"}
    holder = _holder(folder)
    try:
        with pytest.raises(RunFolderBusy, match=f"in use by process {holder.pid}"):
            resume(folder, progress=False)
        assert main(["resume", str(folder)]) == 2  # one line, exit 2
        after = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".lock"}
        assert after == before  # nothing was truncated or appended while the other writer lives
    finally:
        holder.kill()
        holder.wait()
    resume(folder, progress=False)  # the lock died with its holder


def test_a_second_sweep_over_a_live_cell_does_not_touch_it(tiny, tmp_path):
    folder = tmp_path / "cell"
    folder.mkdir()
    holder = _holder(folder)
    try:
        result = run_cell(tiny("rounds=1").model_dump(), str(folder))
    finally:
        holder.kill()
        holder.wait()
    assert result["status"] == "busy" and str(holder.pid) in result["reason"]
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # no error.txt in the other's live cell


def test_a_second_sweep_on_a_folder_in_use_is_refused(tmp_path, capsys):
    """Two sweeps on one folder both ran, each found the other's live cells busy, and the last sweep.json marked
    completed cells 'busy' (issue 32). The second is refused in one line naming the first's process, and
    writes nothing."""
    import yaml

    from conftest import tiny_tree

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree()))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "out"), "overrides": ["rounds=1"],
                                    "grid": {"seed": [0, 1]}}))
    (tmp_path / "out").mkdir()
    holder = _holder(tmp_path / "out")  # as the first sweep holds it
    try:
        capsys.readouterr()
        assert main(["sweep", str(path), "--no-progress"]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert err.startswith(f"fedflat: sweep folder {tmp_path / 'out'} is in use by process {holder.pid}")
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]
    assert main(["sweep", str(path), "--no-progress"]) == 0  # the hold died with its holder
    index = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [c["status"] for c in index["cells"]] == ["completed", "completed"]


def test_files_follow_the_umask(tiny, tmp_path):
    folder = tmp_path / "run"
    old = os.umask(0o022)
    try:
        code = ("import sys; sys.path.insert(0, 'tests'); import fedflat; from conftest import tiny_tree\n"
                "from fedflat.config import load_config\n"
                "fedflat.run(load_config(None, ['rounds=2'], base=tiny_tree()), run_dir=sys.argv[1], progress=False)\n")
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True, cwd=REPO, timeout=120)
    finally:
        os.umask(old)
    for name in ("config.yaml", "summary.json", "model.pt", "checkpoint.pt", "metrics.jsonl"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o644, name


def test_an_unusable_output_folder_is_refused_before_the_data_load(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "under"):
        assert main(["run", "rounds=1", "--out", str(out), "--no-progress"]) == 2
        assert "is a file, not a folder" in capsys.readouterr().err


def test_a_read_only_output_folder_is_refused_before_the_data_load(tmp_path):
    out = _in_small_tmpfs("64k,ro", f"{CLI_SHELL} run rounds=1 --out $T/runs --no-progress; echo EXIT=$?", tmp_path)
    assert "EXIT=2" in out.stdout and "is not writable" in out.stderr, out.stderr[-2000:]


def _in_small_tmpfs(size: str, script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs ``script`` (bash) with $T a tmpfs of ``size``, in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no user/mount namespaces here")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    wrapped = f"mount -t tmpfs -o size={size} tmpfs {mount} && export T={mount} && {script}"
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", wrapped], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~17 s (moved from make test: its 10 minutes)
def test_disk_full_mid_run_records_the_failure_and_resume_is_exact(tmp_path):
    """A 512 KiB tmpfs holds the run's first files but not its checkpoint of the quickstart MLP: the run
    ends with one line, summary.json says failed (never 'running') with what to do; after space is freed
    (here: a bigger disk), resume finishes exactly as an uninterrupted run."""
    out = _in_small_tmpfs("512k", f"{CLI_SHELL} run rounds=6 checkpoint_every=2 --out $T --no-progress; "
                                  "echo EXIT=$?; cp -r $T/. " + str(tmp_path / "saved"), tmp_path)
    assert "EXIT=3" in out.stdout, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) <= 2 and "Traceback" not in out.stderr  # the folder, one error line
    assert "disk full" in out.stderr and "fedflat resume" in out.stderr
    (folder,) = [p for p in (tmp_path / "saved").iterdir() if p.is_dir()]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and "disk full" in summary["reason"]
    checkpoint = read_checkpoint(folder)  # the summary's rounds are the checkpoint's, not those trained since
    assert summary["rounds"] == (checkpoint["round"] if checkpoint is not None else 0)  # (issue 32)
    resumed = resume(folder, progress=False)  # on a disk with room
    full = fedflat.run(None, overrides=["rounds=6", "checkpoint_every=2"], save=False, progress=False)
    assert resumed.summary["status"] == "completed"
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), full.metrics)


@pytest.mark.slow  # ~27 s (moved from make test: its 10 minutes)
def test_a_disk_that_stays_full_leaves_the_summary_at_the_checkpoints_round(tmp_path):
    """A 2 MiB tmpfs holds the round-2 checkpoint of a 300k-parameter MLP but not the round-4 one, even after the
    run gives back its reserve: summary.json said rounds 4 while the checkpoint held round 2 (issue 32). It now
    names the checkpoint's round, where a resume starts."""
    overrides = ["rounds=6", "checkpoint_every=2", "model.hidden=[512,512]"]
    out = _in_small_tmpfs("2m", f"{CLI_SHELL} run {' '.join(overrides)} --out $T --no-progress; echo EXIT=$?; "
                                "cp -r $T/. " + str(tmp_path / "saved"), tmp_path)
    assert "EXIT=3" in out.stdout and "disk full" in out.stderr, out.stderr[-2000:]
    (folder,) = [p for p in (tmp_path / "saved").iterdir() if p.is_dir()]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds"] == read_checkpoint(folder)["round"] == 2
    resumed = resume(folder, progress=False)
    full = fedflat.run(None, overrides=overrides, save=False, progress=False)
    assert resumed.summary["rounds"] == 6 and metrics_equal(resumed.metrics, full.metrics)


@pytest.mark.slow  # ~9 s (moved from make test: its 10 minutes)
def test_a_completely_full_disk_leaves_no_empty_run_folder(tmp_path):
    out = _in_small_tmpfs("64k", f"{CLI_SHELL} run rounds=2 --out $T --no-progress; echo EXIT=$?; ls -A $T",
                          tmp_path)
    assert "EXIT=3" in out.stdout and "no space left" in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "EXIT=3"  # and `ls` printed nothing: no folder left behind


@pytest.mark.slow  # ~25 s (moved from make test: its 10 minutes)
def test_sigterm_stops_a_run_like_ctrl_c(tmp_path):
    proc = subprocess.Popen([*CLI, "run", "rounds=100000",
                             "checkpoint_every=5", "--out", str(tmp_path), "--no-progress"],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    first = proc.stderr.readline()
    assert first.startswith("run folder: ")  # printed at the start, not only at the end
    folder = Path(first.split(": ", 1)[1].strip())
    deadline = time.monotonic() + 120
    while len(read_jsonl(folder / "metrics.jsonl")) < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == "interrupted (SIGTERM)"
    assert read_checkpoint(folder)["round"] == summary["rounds"] >= 6  # a checkpoint of the last complete round
    assert f"fedflat resume {folder}" in err


def test_help_does_not_load_torch():
    code = "import sys; from fedflat.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def _endless_sweep(tmp_path: Path) -> Path:
    """Four cells of the tiny problem that would run for hours: two run at once, two wait."""
    import yaml
    from conftest import tiny_tree

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree()))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "out"),
                                    "overrides": ["rounds=1000000", "checkpoint_every=5", "threads=1"],
                                    "grid": {"seed": [0, 1, 2, 3]}}))
    return path


def _foreground_signals() -> None:
    """A terminal's foreground job takes Ctrl-C: SIGINT at its default. (A test run started as a background job of a
    non-interactive shell, ``make test &``, ignores SIGINT, and an ignored signal is inherited: the sweep would then
    rightly ignore the Ctrl-C this test sends.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_sweep(path: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "sweep", str(path), "--workers", "2", "--no-progress"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                            preexec_fn=_foreground_signals)


def _wait_for_rounds(folders: list[Path], rounds: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(len(read_jsonl(f / "metrics.jsonl")) >= rounds for f in folders):
            return
        time.sleep(0.2)
    raise AssertionError(f"cells did not reach round {rounds}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_ctrl_c_stops_a_sweep_within_seconds_with_each_cells_true_state(tmp_path):
    path = _endless_sweep(tmp_path)
    proc = _start_sweep(path)
    running = [tmp_path / "out" / "seed0", tmp_path / "out" / "seed1"]
    try:
        _wait_for_rounds(running, 6)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
        start = time.monotonic()
        assert proc.wait(timeout=60) == 130
        assert time.monotonic() - start < 20
        assert proc.stderr.read() == "fedflat: interrupted (Ctrl-C)\n"  # (not `interrupted ()`)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    index = json.loads((tmp_path / "out" / "sweep.json").read_text())
    states = {c["name"]: c["status"] for c in index["cells"]}
    assert states == {"seed0": "interrupted", "seed1": "interrupted", "seed2": "pending", "seed3": "pending"}
    for folder in running:
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["reason"].startswith("interrupted")
        assert read_checkpoint(folder)["round"] == summary["rounds"]  # resumable from where it stopped
    assert not (tmp_path / "out" / "seed2").exists()  # no new cell was started


def test_ctrl_c_while_the_workers_start_is_one_line(tmp_path):
    """Ctrl-C reaches the whole process group: a worker still importing printed its 40-line traceback (issue 32),
    and the message read `interrupted ()`. The workers ignore Ctrl-C; the sweep stops them and says so once."""
    proc = _start_sweep(_endless_sweep(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(_spawned_workers(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_spawned_workers(proc.pid)) == 2  # both just started: importing fedflat and torch
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.stderr.read() == "fedflat: interrupted (Ctrl-C)\n"


def _spawned_workers(parent: int) -> list[int]:
    """The sweep's cell processes (multiprocessing's spawn), by their command line."""
    found = []
    for proc_stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(proc_stat.read_text().rsplit(")", 1)[1].split()[1]) == parent and \
                    "spawn_main" in proc_stat.with_name("cmdline").read_text():
                found.append(int(proc_stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


@pytest.mark.slow  # ~12 s (moved from make test: its 10 minutes)
def test_sweep_workers_die_with_a_killed_parent(tmp_path):
    path = _endless_sweep(tmp_path)
    proc = _start_sweep(path)
    running = [tmp_path / "out" / "seed0", tmp_path / "out" / "seed1"]
    try:
        _wait_for_rounds(running, 2)
        workers = [int((f / ".lock").read_text()) for f in running]  # each cell's holder is its worker
        proc.kill()  # SIGKILL: the sweep has no chance to clean up
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in workers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rounds = {f.name: len(read_jsonl(f / "metrics.jsonl")) for f in running}
    time.sleep(2)
    assert {f.name: len(read_jsonl(f / "metrics.jsonl")) for f in running} == rounds  # nobody trains them


@pytest.mark.parametrize("overrides, message", [
    (["device=cuda"] if not __import__("torch").cuda.is_available() else ["device=cuda:99"], "device=cuda"),
    (["device=foo"], "'foo' is not a device"),
    (["data.partition.alpha=0"], "alpha must be a number > 0"),
    (["data.partition.alpha=-1"], "alpha must be a number > 0"),
    (["data.partition=pathological", "data.partition.classes=20"], "classes=20 exceeds the 10 classes"),
    (["data.partition.min_size=500"], "min_size=500"),
    (["data.num_clients=5000"], "num_clients=5000 exceeds"),
    (["data.partition=shards", "data.partition.per_client=1000"], "shards exceed"),
    (["model.hidden=abc"], "hidden must be a sequence"),
    (["model.hidden=[-5]"], "must be a positive integer"),
    (["model.hidden=[]"], "hidden=[] leaves the MLP no hidden layer: for a linear model use model=logreg"),
    (["model=cnn"], "model=cnn on digits"),
    (["model=textcnn"], "model=textcnn on digits"),
])
def test_bad_inputs_are_one_line_errors_that_leave_nothing_behind(tmp_path, capsys, overrides, message):
    assert main(["run", *overrides, "rounds=1", "--out", str(tmp_path / "runs"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fedflat: ") and message in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_file_and_folder_mistakes_are_one_line_errors(tmp_path, capsys):
    """Issue 32: a config path that is a folder was "not found", a YAML error named `<unicode string>` over five
    lines (in a sweep file: a traceback), and `--out /proc/x` ended in a bare errno."""
    (tmp_path / "folder").mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 3\ndata: {name: digits\n")
    cases = [(["run", str(tmp_path / "folder")], f"config file '{tmp_path / 'folder'}' is a folder, not a file"),
             (["sweep", str(tmp_path / "folder")], f"sweep file '{tmp_path / 'folder'}' is a folder, not a file"),
             (["run", str(bad)], f"{bad}, line 3, column 1: not valid YAML: expected ',' or '}}', but got"),
             (["sweep", str(bad)], f"{bad}, line 3, column 1: not valid YAML: expected ',' or '}}', but got")]
    if Path("/proc").is_dir():
        cases.append((["run", "rounds=1", "--out", "/proc/fedflat"],
                      "output folder /proc/fedflat: cannot be made in /proc (No such file or directory)"))
    for argv, message in cases:
        assert main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"fedflat: {message}"), err


def test_bench_on_a_missing_gpu_is_a_clear_error(capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--device", "cuda", "--rounds", "1", "--quiet"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def _user_data(**change):
    import torch

    from fedflat.data import Dataset

    g = torch.Generator().manual_seed(0)
    fields = {"x_train": torch.randn(60, 5, generator=g), "y_train": torch.randint(0, 3, (60,), generator=g),
              "x_test": torch.randn(20, 5, generator=g), "y_test": torch.randint(0, 3, (20,), generator=g)}
    fields.update(change)
    return lambda: Dataset("mine", fields["x_train"], fields["y_train"], fields["x_test"], fields["y_test"], 3)


def test_user_inputs_are_checked_before_a_run_folder_exists(tmp_path):
    import numpy as np
    import torch

    from fedflat.data import DatasetError

    bad = {
        "float labels": (_user_data(y_train=torch.rand(60)), "labels must be integer class ids"),
        "label out of range": (_user_data(y_train=torch.full((60,), 3)), "labels must be 0 .. num_classes - 1"),
        "negative label": (_user_data(y_test=torch.full((20,), -1)), "labels must be 0 .. num_classes - 1"),
        "1-D x": (_user_data(x_train=torch.randn(60)), "needs a sample dimension"),
        "float64 x": (_user_data(x_train=torch.randn(60, 5, dtype=torch.float64)), "pass x_train.float()"),
        "uint8 x": (_user_data(x_train=torch.zeros(60, 5, dtype=torch.uint8)), "divide by 255"),
        "lengths differ": (_user_data(y_train=torch.zeros(55, dtype=torch.long)), "one label per sample \\(60"),
        "feature width": (_user_data(x_test=torch.randn(20, 7)), "both splits need the same features"),
        "NaN in x_train": (_user_data(x_train=torch.full((60, 5), float("nan"))), "NaN or infinite"),
        "NaN in x_test": (_user_data(x_test=torch.full((20, 5), float("inf"))), "NaN or infinite"),
    }
    for case, (make, message) in bad.items():
        with pytest.raises(DatasetError, match=message):
            make()
    ok = _user_data(x_train=np.random.default_rng(0).normal(size=(60, 5)).astype("float32"))()  # NumPy is fine
    assert isinstance(ok.x_train, torch.Tensor)
    cfg = {"rounds": 1, "data": {"num_clients": 3, "partition": {"scheme": "iid"}}, "sampling": {"clients_per_round": 2}}
    with pytest.raises(fedflat.ConfigError, match="model_fn must return a torch.nn.Module"):
        fedflat.run(cfg, dataset=ok, model_fn=lambda: "not a model", out=tmp_path, progress=False)
    with pytest.raises(fedflat.ConfigError, match="does not accept mine's inputs of shape"):
        fedflat.run(cfg, dataset=ok, model_fn=lambda: torch.nn.Linear(9, 3), out=tmp_path, progress=False)
    for outputs in (2, 4):  # 3 classes: torch's raw IndexError deep in training, or a silent run (issue 32)
        with pytest.raises(fedflat.ConfigError, match=f"the model gives {outputs} outputs for mine's 3 classes: its "
                                                      "last layer needs 3 outputs"):
            fedflat.run(cfg, dataset=ok, model_fn=lambda: torch.nn.Linear(5, outputs), out=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # no run folder with an untrained model.pt
    hist = fedflat.run(cfg, dataset=ok, model_fn=lambda: torch.nn.Linear(5, 3), out=tmp_path, progress=False)
    assert "-mine-" in hist.run_dir.name  # the folder names the user's dataset


