"""Loading files is safe and says what is wrong (issues 43.7 and 44.5): checkpoints and models are read with
``torch.load(weights_only=True)``, a crafted pickle is refused without running anything, a checkpoint of the format
written before is still resumed, and a corrupt file is one line naming it and what to do."""
from __future__ import annotations

import gzip
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

import fedflat
from fedflat.cli import main
from fedflat.engine.checkpoint import CHECKPOINT, CheckpointError, UnsafeFile, plain, read_checkpoint
from fedflat.experiments.resume import metrics_equal, resume


class _Payload:
    """Pickled as ``exec(code)``: what a crafted checkpoint would run on an unsafe ``torch.load``."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def _one_line_error(capsys, *paths) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for path in paths:
        assert str(path) in err, err
    return err


@pytest.fixture
def run_folder(tiny, tmp_path):
    folder = tmp_path / "run"
    fedflat.run(tiny("rounds=2"), run_dir=folder, progress=False)
    return folder


def test_a_crafted_checkpoint_is_refused_by_resume_and_analyze_and_runs_nothing(run_folder, tmp_path, capsys):
    marker = tmp_path / "marker"
    crafted = {"format": 1, "round": 1, "state": _Payload(f"open({str(marker)!r}, 'w').close()")}
    torch.save(crafted, run_folder / CHECKPOINT)
    before = {p.name: p.read_bytes() for p in run_folder.iterdir() if p.is_file() and p.name != ".lock"}
    assert main(["resume", str(run_folder), "--no-progress"]) == 2
    err = _one_line_error(capsys, run_folder / CHECKPOINT)
    assert "refused" in err and "object builtins.exec " in err
    assert main(["analyze", "sharpness", str(run_folder)]) == 2
    _one_line_error(capsys, run_folder / CHECKPOINT)
    with pytest.raises(UnsafeFile):
        read_checkpoint(run_folder)
    from conftest import tiny_tree

    from fedflat.experiments.sweep import run_cell

    cell = run_cell(tiny_tree(rounds=3), str(run_folder))  # a sweep rerun over the cell, extended: a resume
    assert cell["status"] == "failed" and "refused" in cell["reason"]
    (run_folder / "error.txt").unlink()
    assert not marker.exists()  # nothing of the file ran
    after = {p.name: p.read_bytes() for p in run_folder.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before  # and nothing in the folder was written
    torch.load(run_folder / CHECKPOINT, weights_only=False)  # the file is truly malicious: an unsafe load runs it
    assert marker.exists()


def test_a_crafted_model_file_is_refused(run_folder, tmp_path, capsys):
    marker = tmp_path / "marker"
    (run_folder / CHECKPOINT).unlink()  # analyze then reads model.pt
    torch.save({"w": _Payload(f"open({str(marker)!r}, 'w').close()")}, run_folder / "model.pt")
    assert main(["analyze", "sharpness", str(run_folder)]) == 2
    assert "refused" in _one_line_error(capsys, run_folder / "model.pt")
    assert not marker.exists()


def test_a_checkpoint_in_the_previous_format_still_resumes_exactly(tiny, tmp_path):
    """Checkpoints written before :func:`plain` hold ``torch.__version__`` (a TorchVersion, not a plain str): a run
    resumed from one equals the uninterrupted run."""
    whole = fedflat.run(tiny("rounds=4"), run_dir=tmp_path / "whole", progress=False)
    folder = tmp_path / "old"
    fedflat.run(tiny("rounds=2"), run_dir=folder, progress=False)
    payload = read_checkpoint(folder)
    payload["summary"]["versions"]["torch"] = torch.__version__  # as the previous writer left it
    assert type(payload["summary"]["versions"]["torch"]) is not str
    torch.save(payload, folder / CHECKPOINT)
    with pytest.raises(pickle.UnpicklingError):  # not loadable by weights_only=True alone: the format differs
        torch.load(folder / CHECKPOINT, weights_only=True)
    resumed = resume(folder, overrides=["rounds=4"], progress=False)
    assert metrics_equal(resumed.metrics, whole.metrics)
    assert torch.equal(resumed.final_parameters, whole.final_parameters)
    new = torch.load(folder / CHECKPOINT, weights_only=True)  # and what it writes now is plain
    assert type(new["summary"]["versions"]["torch"]) is str


def test_plain_keeps_values_and_drops_types():
    import numpy as np

    value = plain({"a": np.float32(0.5), 3: (1, np.int64(2)), "t": torch.ones(2), "v": torch.__version__})
    assert value == {"a": 0.5, 3: [1, 2], "t": value["t"], "v": str(torch.__version__)}
    assert type(value["a"]) is float and type(value[3][1]) is int and type(value["v"]) is str
    with pytest.raises(TypeError, match="plain values only, not object"):
        plain({"x": object()})


def test_a_checkpoint_with_missing_keys_is_one_line(run_folder, capsys):
    payload = read_checkpoint(run_folder)
    del payload["metrics"], payload["state"]["store"]
    torch.save(payload, run_folder / CHECKPOINT)
    assert main(["resume", str(run_folder), "rounds=3", "--no-progress"]) == 2
    err = _one_line_error(capsys, run_folder / CHECKPOINT)
    assert "lacks metrics, state.store" in err and "fedflat resume" in err
    with pytest.raises(CheckpointError, match="lacks metrics"):
        read_checkpoint(run_folder)


def test_a_truncated_checkpoint_is_one_line(run_folder, capsys):
    data = (run_folder / CHECKPOINT).read_bytes()
    (run_folder / CHECKPOINT).write_bytes(data[: len(data) // 2])
    assert main(["resume", str(run_folder), "rounds=3", "--no-progress"]) == 2
    assert "unreadable checkpoint" in _one_line_error(capsys, run_folder / CHECKPOINT)
    (run_folder / CHECKPOINT).write_bytes(b"not a checkpoint")  # no pickle of torch's: never advise an unsafe load
    assert main(["resume", str(run_folder), "rounds=3", "--no-progress"]) == 2
    err = _one_line_error(capsys, run_folder / CHECKPOINT)
    assert "unreadable checkpoint (not tensors and plain values" in err and "weights_only" not in err


def test_a_truncated_model_file_is_one_line_in_analyze(run_folder, capsys):
    (run_folder / CHECKPOINT).unlink()
    model = run_folder / "model.pt"
    model.write_bytes(model.read_bytes()[:200])
    assert main(["analyze", "sharpness", str(run_folder)]) == 2
    err = _one_line_error(capsys, model)
    assert "unreadable model file" in err and "restore it from a copy" in err


def test_model_file_bytes_are_identical_between_identical_runs(tiny, tmp_path):
    """torch names a zip archive's records after the file it writes; model.pt went through a randomly named
    temporary file, so two identical runs gave equal tensors in different bytes."""
    for name in ("a", "b"):
        fedflat.run(tiny("rounds=1"), run_dir=tmp_path / name, progress=False)
    assert (tmp_path / "a" / "model.pt").read_bytes() == (tmp_path / "b" / "model.pt").read_bytes()


def _gz(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as fh:
        fh.write(data)
    return buffer.getvalue()


def _fmnist(tmp_path):
    from test_data import make_idx_dataset

    folder = tmp_path / "data" / "fashion-mnist"
    make_idx_dataset(folder, seed=0, gz=True)
    return folder


def _run_fmnist(tmp_path) -> int:
    return main(["run", "rounds=1", "threads=1", "data.name=fmnist", f"data.root={tmp_path / 'data'}", "--out",
                 str(tmp_path / "runs"), "--no-progress"])


def test_a_truncated_fashion_mnist_gz_is_one_line_naming_it(tmp_path, capsys):
    images = _fmnist(tmp_path) / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:-100])  # gzip then ends before its end-of-stream marker (EOFError)
    assert _run_fmnist(tmp_path) == 2
    err = _one_line_error(capsys, images)
    assert "truncated or corrupt" in err and "download it again" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run folder left


def test_a_garbage_labels_file_is_one_line_naming_it(tmp_path, capsys):
    labels = _fmnist(tmp_path) / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(_gz(bytes(range(256)) * 3))
    assert _run_fmnist(tmp_path) == 2
    assert "not an IDX file" in _one_line_error(capsys, labels)


def test_a_truncated_cifar_batch_is_one_line_naming_it(tmp_path, capsys):
    from test_data import make_cifar

    make_cifar(tmp_path / "data" / "cifar10")
    batch = tmp_path / "data" / "cifar10" / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:500])
    assert main(["run", "rounds=1", "data.name=cifar10", f"data.root={tmp_path / 'data'}", "--out",
                 str(tmp_path / "runs"), "--no-progress"]) == 2
    assert "truncated or corrupt" in _one_line_error(capsys, batch)


def test_every_load_in_the_package_is_safe():
    """No ``torch.load`` without ``weights_only=True``, no ``allow_pickle=True``, no pickle or YAML loader that
    builds arbitrary objects (the crafted-file tests above check the behaviour; this keeps new code to it)."""
    import re
    from pathlib import Path

    import yaml

    from fedflat.config import _Loader

    assert issubclass(_Loader, yaml.SafeLoader)
    for path in Path(fedflat.__file__).parent.rglob("*.py"):
        text = path.read_text()
        for call in re.findall(r"torch\.load\(([^)]*)\)", text):
            assert "weights_only=True" in call, f"{path}: torch.load({call})"
        assert "allow_pickle=True" not in text, path
        for loader in re.findall(r"yaml\.(?:load|unsafe_load|full_load)\(([^)]*)\)", text):
            assert "Loader=_Loader" in loader, f"{path}: yaml load with {loader}"
        if "pickle" in text and path.name != "readers.py":  # CIFAR's unpickler rebuilds arrays only
            assert not re.search(r"pickle\.(load|loads|Unpickler)\b", text), path


# -- issue 54: every command's loads, any Python object, any torch wording -------------------------------------------
class _Call:
    """Pickled as ``function(*args)``: a crafted file's payload naming any callable, e.g. ``posix.system``."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def _payloads(marker):
    import os

    return {"posix.system": _Call(os.system, f"touch {marker}"),
            "builtins.eval": _Call(eval, f"open({str(marker)!r}, 'w').close()"),
            "builtins.exec": _Call(exec, f"open({str(marker)!r}, 'w').close()")}


def _no_unsafe_advice(err: str) -> None:
    assert "weights_only" not in err and "Traceback" not in err and "UnpicklingError" not in err, err


@pytest.fixture
def personal_run(tiny, tmp_path):
    folder = tmp_path / "per"
    fedflat.run(tiny("algo=fedper", "rounds=1"), run_dir=folder, progress=False)
    return folder


@pytest.mark.parametrize("protocol", [2, 4])  # (torch's default; 4 names objects with STACK_GLOBAL)
@pytest.mark.parametrize("name", ["posix.system", "builtins.eval", "builtins.exec"])
def test_a_pickle_naming_any_python_object_is_refused_by_every_command(name, protocol, personal_run, tmp_path,
                                                                      capsys):
    """Issue 54: `fedflat evaluate` of a crafted model.pt or personal.pt showed torch's raw UnpicklingError (which
    advises loading with weights_only=False, the exploit), and a checkpoint naming posix.system was "unreadable",
    not refused. Every file each command loads, crafted as a real pickle of the object, is refused in one line that
    names the file and the object, with no advice to load it unsafely, and nothing of it runs."""
    from fedflat.experiments.personal import PERSONAL_FILE

    marker = tmp_path / "marker"
    payload = _payloads(marker)[name]
    good = {f: (personal_run / f).read_bytes() for f in (CHECKPOINT, "model.pt", PERSONAL_FILE)}
    runs = {CHECKPOINT: [["resume", str(personal_run), "rounds=2", "--no-progress"],
                         ["analyze", "sharpness", str(personal_run)]],
            "model.pt": [["evaluate", str(personal_run)], ["evaluate", "--global", str(personal_run)]],
            PERSONAL_FILE: [["evaluate", str(personal_run)]]}
    for file, commands in runs.items():
        torch.save({"format": 1, "round": 1, "state": payload}, personal_run / file, pickle_protocol=protocol)
        if file == "model.pt":  # (analyze reads model.pt where there is no checkpoint)
            (personal_run / CHECKPOINT).unlink()
            commands = [*commands, ["analyze", "sharpness", str(personal_run)]]
        for command in commands:
            assert main(command) == 2, command
            err = _one_line_error(capsys, personal_run / file)
            assert f"refused: this {'checkpoint' if file == CHECKPOINT else file.split('.')[0] + ' file'} would " \
                   f"rebuild the Python object {name} on load" in err, (command, err)
            _no_unsafe_advice(err)
        for restored, data in good.items():
            (personal_run / restored).write_bytes(data)
    assert not marker.exists()
    torch.load(personal_run / CHECKPOINT, weights_only=True)  # (the folder is whole again: the refusals wrote nothing)


def test_torchs_own_refusal_is_a_refusal_in_every_wording(run_folder, tmp_path, monkeypatch):
    """Should a pickle name an object in a form fedflat's own opcode scan misses, torch's weights_only unpickler
    refuses it, and its wording differs by version: torch 2.6's "Unsupported global: GLOBAL x", 2.13's "Trying to load
    unsupported GLOBAL x whose module ... is blocked". Both are a refusal naming x, never "unreadable"."""
    import os

    from fedflat.engine import checkpoint

    monkeypatch.setattr(checkpoint, "named_objects", lambda path: [])  # (the scan misses it: torch's layer alone)
    torch.save({"w": _Call(os.system, f"touch {tmp_path / 'marker'}")}, tmp_path / "bad.pt")
    with pytest.raises(UnsafeFile, match="would rebuild the Python object posix.system on load"):
        checkpoint.safe_load(tmp_path / "bad.pt", "model file", "restore it")
    for wording in (("Weights only load failed. ... Unsupported global: GLOBAL posix.system was not an allowed global "
                     "by default. Please use `torch.serialization.add_safe_globals([system])` ... weights_only=False"),
                    ("Weights only load failed. ... Trying to load unsupported GLOBAL posix.system whose module posix "
                     "is blocked. ... re-running `torch.load` with `weights_only` set to `False` will likely succeed")):
        def load(*args, text=wording, **kwargs):
            raise pickle.UnpicklingError(text)

        monkeypatch.setattr(torch, "load", load)
        with pytest.raises(UnsafeFile) as refused:
            checkpoint.safe_load(tmp_path / "bad.pt", "model file", "restore it")
        assert "Python object posix.system on load" in str(refused.value) and "weights_only" not in str(refused.value)
    assert not (tmp_path / "marker").exists()


def test_files_of_tensors_saved_in_either_format_and_protocol_still_load(tmp_path):
    """The opcode scan passes what torch itself writes, the zip format and the legacy one, and reads the names of
    protocol 4's STACK_GLOBAL (which torch's weights_only unpickler does not load: FRAME is not among its opcodes)."""
    from fedflat.engine.checkpoint import named_objects, safe_load

    value = {"w": torch.arange(5.0), "n": [1, 2.5, "x", None], "version": str(torch.__version__)}
    for zip_format in (True, False):
        for protocol in (2, 4):
            path = tmp_path / f"ok-{zip_format}-{protocol}.pt"
            torch.save(value, path, pickle_protocol=protocol, _use_new_zipfile_serialization=zip_format)
            assert "torch._utils._rebuild_tensor_v2" in named_objects(path)
            if protocol == 4:
                continue
            loaded = safe_load(path, "file", "fix it")
            assert torch.equal(loaded["w"], value["w"]) and loaded["n"] == value["n"]


def test_fedflat_report_of_a_crafted_config_runs_nothing(run_folder, tmp_path, capsys):
    """`fedflat report` reads a run folder's config.yaml, summary.json and metrics.jsonl (no torch file); a config.yaml
    whose YAML tags ask for Python objects is not built (safe YAML): the folder is left out, named, and nothing ran."""
    marker = tmp_path / "marker"
    (run_folder / "config.yaml").write_text(f"seed: !!python/object/apply:os.system ['touch {marker}']\n"
                                            + (run_folder / "config.yaml").read_text())
    assert main(["report", str(run_folder)]) == 2  # (its only folder skipped: no run to report)
    warning = capsys.readouterr().err.strip().splitlines()[0]
    assert warning.startswith(f"fedflat report: warning: skipped {run_folder}: could not determine a constructor for "
                              "the tag 'tag:yaml.org,2002:python/object/apply:os.system'"), warning
    assert main(["report", str(run_folder), "--plot", str(tmp_path / "figures")]) == 2
    assert not marker.exists()


# -- a checkpoint that is not a regular file, or a zip file two readers read differently ---------------------------
@pytest.mark.skipif(not Path("/dev/zero").exists() or not hasattr(os, "mkfifo"), reason="POSIX devices and FIFOs")
def test_a_checkpoint_that_is_a_device_a_fifo_or_too_large_is_refused_before_it_is_read(run_folder, tmp_path):
    """`checkpoint.pt` a symbolic link to /dev/zero: the zip test read it without end until the kernel killed the
    process at 11 GB. Now `fedflat resume` of such a folder says in one line that it is not a regular file, at once:
    run in a process whose address space is capped at 3 GiB, so a regression fails here instead of filling the
    machine's memory. A FIFO nobody writes is refused without waiting for a writer; a regular file larger than the cap
    (here a cap of 100 bytes) is refused naming its size; a folder is refused like a device."""
    import resource
    import subprocess
    import sys

    from fedflat.files import safe_load

    checkpoint = run_folder / CHECKPOINT
    checkpoint.unlink()
    checkpoint.symlink_to("/dev/zero")

    def capped():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = subprocess.run([sys.executable, "-m", "fedflat.cli", "resume", str(run_folder), "--no-progress"],
                          capture_output=True, text=True, timeout=300, preexec_fn=capped,
                          env={**os.environ, "PYTHONPATH": str(Path(fedflat.__file__).parents[1])})
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"fedflat: {checkpoint}: refused: this checkpoint is not a regular file (a device, FIFO, "
                           "socket or folder, or a link to one), which could be read without end; "), line
    os.mkfifo(tmp_path / "fifo.pt")
    for odd in (tmp_path / "fifo.pt", tmp_path):
        with pytest.raises(CheckpointError, match="not a regular file"):
            safe_load(odd, "model file", "restore it")
    torch.save({"w": torch.ones(50)}, tmp_path / "big.pt")
    size = (tmp_path / "big.pt").stat().st_size
    with pytest.raises(CheckpointError, match=f"holds {size} bytes, more than the 100 that can be loaded here"):
        safe_load(tmp_path / "big.pt", "model file", "restore it", max_bytes=100)
    assert torch.equal(safe_load(tmp_path / "big.pt", "model file", "restore it")["w"], torch.ones(50))


def _rezip(target: Path, members, compression: int = 0) -> None:
    """``target``: a zip file of ``members`` [(name, bytes)], stored as torch stores its records (``compression`` 0),
    or compressed (``zipfile.ZIP_DEFLATED``)."""
    import zipfile

    with zipfile.ZipFile(target, "w") as archive:
        for name, data in members:
            info = zipfile.ZipInfo(name)
            info.compress_type = compression
            archive.writestr(info, data)


def test_a_zip_file_whose_members_two_readers_could_read_differently_is_refused(tmp_path):
    """A torch zip file with two `data.pkl` members: the scan read one of them twice (it looked members up by name),
    torch loads one of them: the two could differ. Such a file is refused whatever the second member holds; so is one
    whose names differ only in case (torch's reader looks records up without case: a `DATA.PKL` holding the data is
    loaded, and the scan reads it as the pickle it is), and one whose members unpack beyond the cap (a small file of
    compressed zeros). What torch.save writes still loads."""
    import warnings
    import zipfile

    from fedflat.files import named_objects, safe_load

    torch.save({"w": torch.arange(3.0)}, tmp_path / "ok.pt")
    with zipfile.ZipFile(tmp_path / "ok.pt") as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    pkl = next(name for name, _ in members if name.endswith("/data.pkl"))
    harmless = dict(members)[pkl]
    evil = pickle.dumps(_Payload("raise SystemExit('ran')"), protocol=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (zipfile warns of the duplicate name it is asked to write)
        _rezip(tmp_path / "twice.pt", [(pkl, harmless)] + members)
        _rezip(tmp_path / "case.pt", [(pkl.upper(), evil)] + members)
    for name in ("twice.pt", "case.pt"):
        with pytest.raises(UnsafeFile, match=f"not a zip file torch.save wrote: it holds 2 members named"):
            safe_load(tmp_path / name, "checkpoint", "restore it")
    _rezip(tmp_path / "upper.pt", [(pkl.upper(), evil) if n == pkl else (n, d) for n, d in members])
    assert "builtins.exec" in named_objects(tmp_path / "upper.pt")  # (the scan reads a .PKL member as torch would)
    with pytest.raises(UnsafeFile, match="would rebuild the Python object builtins.exec on load"):
        safe_load(tmp_path / "upper.pt", "checkpoint", "restore it")
    _rezip(tmp_path / "bomb.pt", members + [(pkl.rsplit("/", 1)[0] + "/data/9", bytes(10**6))], zipfile.ZIP_DEFLATED)
    cap = 4 * (tmp_path / "bomb.pt").stat().st_size  # (a megabyte of zeros deflates a thousandfold)
    with pytest.raises(UnsafeFile, match=f"its members unpack to [0-9]+ bytes, more than the {cap} that can be loaded"):
        safe_load(tmp_path / "bomb.pt", "checkpoint", "restore it", max_bytes=cap)
    assert torch.equal(safe_load(tmp_path / "ok.pt", "checkpoint", "restore it")["w"], torch.arange(3.0))
