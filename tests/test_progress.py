"""Progress off a terminal: plain lines at a fixed interval and at the end, each with the true count, rate, time
left and the last accuracy (issue 35 item 4, issue 32 item 9)."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedflat.files import read_jsonl
from fedflat.progress import INTERVAL_ENV, LogProgress, log_interval, progress_bar

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(?P<desc>\w+): round (?P<n>\d+)/(?P<total>\d+) \((?P<pct>\d+)%\), "
                  r"(?P<rate>[\d.e+-]+|\?) round/s, ETA (?P<eta>[\d:]+|\?), elapsed (?P<elapsed>[\d:]+)"
                  r"(?:, acc=(?P<acc>[\d.]+) loss=(?P<loss>[\d.]+))?$")


class Clock:
    """A clock the test moves: each round takes ``step`` seconds."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        return self.now


def test_a_line_every_interval_and_at_the_end_with_count_rate_and_eta():
    log, clock = io.StringIO(), Clock(10.0)
    bar = LogProgress(range(2, 10), stream=log, interval=25.0, desc="fedsam", unit="round", total=10, initial=2,
                      clock=clock)
    for t in bar:  # rounds 3..10 of a run resumed after round 2, 10 s each
        clock.now += 10.0
        bar.set_postfix(acc=f"{t / 10:.3f}", loss="0.500", refresh=False)  # as a run does
    bar.close()
    lines = log.getvalue().splitlines()
    # a line when 25 s have passed since the last one (at 30, 60 s), none for the others, one at the end
    assert lines == [
        "fedsam: round 5/10 (50%), 0.1 round/s, ETA 0:00:50, elapsed 0:00:30, acc=0.400 loss=0.500",
        "fedsam: round 8/10 (80%), 0.1 round/s, ETA 0:00:20, elapsed 0:01:00, acc=0.700 loss=0.500",
        "fedsam: round 10/10 (100%), 0.1 round/s, ETA 0:00:00, elapsed 0:01:20, acc=0.900 loss=0.500"]


def test_a_sweep_waiting_on_its_cells_prints_their_rounds_at_the_interval():
    log, clock = io.StringIO(), Clock(0)
    bar = LogProgress(stream=log, interval=30.0, desc="cells", unit="cell", total=4, clock=clock)
    for second in range(1, 100):  # the sweep polls its workers every second
        clock.now = float(second)
        bar.set_postfix_str(f"fedavg r{second // 10}; fedsam r{second // 12}")
    assert log.getvalue().splitlines() == [
        "cells: cell 0/4 (0%), ? cell/s, ETA ?, elapsed 0:00:30, fedavg r3; fedsam r2",
        "cells: cell 0/4 (0%), ? cell/s, ETA ?, elapsed 0:01:00, fedavg r6; fedsam r5",
        "cells: cell 0/4 (0%), ? cell/s, ETA ?, elapsed 0:01:30, fedavg r9; fedsam r7"]


def test_the_interval_is_a_setting(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert log_interval() == 30.0  # the documented default
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert log_interval() == 0.5
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match="give the seconds between progress lines"):
        log_interval()


def test_a_terminal_gets_tqdm_and_a_log_plain_lines():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress_bar(range(3), stream=Terminal()), LogProgress)
    log = io.StringIO()
    for _ in progress_bar(range(3), stream=log, desc="fedavg", unit="round", interval=3600):
        pass
    assert log.getvalue() == ""  # nothing before the interval ...
    assert not isinstance(progress_bar(range(3), stream=log, enabled=False), LogProgress)


def test_a_piped_run_prints_the_true_round_rate_eta_and_last_accuracy(tmp_path):
    """A real run with stderr piped and a short interval: every line parses, counts up to the last round, and
    shows the accuracy of the last evaluated round (from metrics.jsonl) — never a stale count."""
    code = ("import fedflat, sys; sys.path.insert(0, 'tests'); from conftest import tiny_tree; "
            f"fedflat.run(tiny_tree(), overrides=['rounds=9', 'eval.every=2'], run_dir={str(tmp_path / 'run')!r})")
    env = {**os.environ, INTERVAL_ENV: "0"}  # a line at every round
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "\r" not in out.stderr and "\x1b" not in out.stderr
    lines = [LINE.match(line) for line in out.stderr.splitlines() if line.startswith("FedAvg:")]
    assert all(lines), out.stderr
    acc = {m["round"]: m["test_acc"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert [int(m["n"]) for m in lines] == [*range(1, 10), 9]  # a line per round (interval 0) and the end
    for m in lines:
        n = int(m["n"])
        assert m["total"] == "9" and int(m["pct"]) == round(100 * n / 9) and float(m["rate"]) > 0
        evaluated = [r for r in acc if r <= n]
        assert (m["acc"] is None) == (not evaluated)
        if evaluated:
            assert m["acc"] == f"{acc[max(evaluated)]:.3f}"
    assert lines[-1]["eta"] == "0:00:00"


def test_a_terminal_of_width_0_still_shows_the_bar():
    """A pseudo-terminal nobody sized reports 0 columns (``docker exec -t``, some CI runners): tqdm drew a bar of
    no width, so a run showed nothing. Its bar is now FALLBACK_COLUMNS wide."""
    import select

    from fedflat.progress import FALLBACK_COLUMNS, terminal_columns

    master, slave = os.openpty()  # a new pseudo-terminal has 0 columns until someone sizes it
    try:
        with os.fdopen(slave, "w") as stream:
            assert terminal_columns(stream) == 0
            bar = progress_bar(range(3), stream=stream, desc="fedsam", unit="round", dynamic_ncols=True, total=3)
            for _ in bar:
                pass
            bar.close()
            stream.flush()
            out = b""
            while select.select([master], [], [], 0.5)[0]:
                chunk = os.read(master, 4096)
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(master)
    last = out.decode().replace("\r\n", "\n").split("\r")[-1].strip()
    assert last.startswith("fedsam: 100%") and "3/3" in last and len(last) == FALLBACK_COLUMNS
