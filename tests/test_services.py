"""External services wait a bounded, configurable time and say what they wait for (issue 44.4, 44.7): an unreachable
MLflow server stopped a run for 4-5 minutes without a word; W&B given an unwritable ``dir`` wrote elsewhere."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

import fedflat
from fedflat.experiments.callbacks import CallbackError, CallbackWarning
from fedflat.experiments.loggers import NOTICE_SECONDS, build_loggers
from fedflat.experiments.rundir import TRACKING_FILE

pytest.importorskip("mlflow")


def _entries(tiny, logger: str):
    return tiny(f"loggers=[{logger}]").loggers


@pytest.mark.slow  # 2 s of backoff, twice
def test_an_unreachable_mlflow_server_is_an_error_within_the_timeout_or_a_warning(tiny):
    """Nothing listens on port 9: each of the 3 attempts is refused at once, and urllib3 waits 0 then 2 s between
    them (backoff factor 1): about 2 s in all, against MLflow's own 7 retries over minutes."""
    import mlflow  # noqa: F401 - its import is not the wait measured

    start = time.monotonic()
    with pytest.raises(CallbackError, match="mlflow: the tracking store http://127.0.0.1:9 cannot be used"):
        build_loggers(_entries(tiny, "{name: mlflow, tracking_uri: 'http://127.0.0.1:9', timeout: 5}"))
    assert time.monotonic() - start < 3 * 5 + 2  # the bound the timeout sets, even had each attempt waited it out
    with pytest.warns(CallbackWarning, match="cannot be used.*goes on without it"):
        assert build_loggers(_entries(tiny, "{name: mlflow, optional: true, tracking_uri: 'http://127.0.0.1:9', "
                                            "timeout: 5}")) == []
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ  # MLflow's settings given back


@pytest.mark.slow  # waits out the timeout three times
def test_a_silent_mlflow_server_is_named_within_seconds_and_given_up_after_the_timeout(tiny, capfd):
    """A server that accepts connections and never answers: each of 3 attempts waits the 2 s timeout, 0 then 2 s
    apart: 8 s, over :data:`NOTICE_SECONDS`."""
    import mlflow  # noqa: F401

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel completes the connections; nobody reads or answers
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(CallbackError, match=f"the tracking store {uri} cannot be used"):
            build_loggers(_entries(tiny, f"{{name: mlflow, tracking_uri: '{uri}', timeout: 2}}"))
        elapsed = time.monotonic() - start
    assert NOTICE_SECONDS < 3 * 2 <= elapsed < 3 * 2 + 2 + 5  # the three waits, + backoff and a loaded machine's 5 s
    assert f"fedflat: waiting for the MLflow tracking store {uri} (at most about 8 s" in capfd.readouterr().err


@pytest.fixture
def unwritable(monkeypatch, tmp_path):
    """A folder this process may not write (a root test process writes anywhere: os.access is what W&B asks)."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access",
                        lambda path, mode, **kw: False if Path(path) == folder else real(path, mode, **kw))
    return folder


@pytest.mark.slow  # W&B's import and start
def test_wandb_given_an_unwritable_dir_refuses_it_instead_of_writing_elsewhere(tiny, tmp_path, unwritable):
    pytest.importorskip("wandb")
    logger = f"{{name: wandb, mode: offline, dir: '{unwritable}'}}"
    with pytest.raises(CallbackError, match=f"its dir {unwritable} is not writable: give the logger a writable dir"):
        fedflat.run(tiny(f"loggers=[{logger}]"), out=tmp_path / "out", progress=False)
    assert not any((tmp_path / "out").iterdir())
    with pytest.warns(CallbackWarning, match="not writable"):
        hist = fedflat.run(tiny(f"loggers=[{logger[:-1]}, optional: true}}]"), out=tmp_path / "out", progress=False)
    assert hist.summary["status"] == "completed"


@pytest.mark.slow  # W&B's import and start
def test_wandb_records_where_it_wrote(tiny, tmp_path):
    pytest.importorskip("wandb")
    hist = fedflat.run(tiny("rounds=1", "loggers=[{name: wandb, mode: offline}]"), run_dir=tmp_path / "run",
                       progress=False)
    tracking = json.loads((hist.run_dir / TRACKING_FILE).read_text())
    assert tracking["wandb"]["dir"] == str((tmp_path / "run").absolute())
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{tracking['wandb']['id']}"))
