"""Ends what is left of a local Ray instance when the process that started it is gone, even after a SIGKILL.

Ray ties the GCS and raylet it starts to the driver (they get SIGKILL when it dies), not the raylet's agents:
``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` notice that their raylet is gone, then try for 60 s to tell
the dead GCS before they exit (Ray 2.55's ``process_watcher``). A driver killed with SIGKILL left them 61 s.
fedflat starts this watchdog with every local Ray instance it starts
(:func:`fedflat.engine.ray_executor.connect`): while its standard input, a pipe only the driver holds, stays open,
it follows the tree of the Ray processes every half second; when the pipe closes (the driver shut Ray down, or
died), it kills every process of that tree still alive. Run as a script (``python reaper.py PID...``, the
Ray processes the driver started), it imports only the standard library. Linux (``/proc``) only.
"""
from __future__ import annotations

import os
import select
import signal
import sys

POLL_S = 0.5  # how often the tree is followed while the driver lives


def processes() -> dict[int, tuple[int, int]]:
    """Every process: pid -> (parent pid, start time in clock ticks since boot)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue  # gone meanwhile
        table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def tree(roots: list[int], table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """The living ``roots`` and all their descendants: pid -> start time."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [pid for pid in roots if pid in table]
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return found


def end(known: dict[int, int]) -> None:
    """SIGKILL to every process in ``known`` that still runs (the same process: the same start time). They belong
    to an instance whose driver is gone: nothing of theirs is worth a graceful exit (an agent given SIGTERM
    still waits on the dead GCS)."""
    table = processes()
    for pid, start in known.items():
        if pid in table and table[pid][1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def watch(roots: list[int]) -> None:
    """Follows the tree of ``roots`` until standard input closes, then ends it."""
    known: dict[int, int] = {}
    while True:
        known.update(tree(roots, processes()))  # orphans keep their entry: their parent (the raylet) may be gone
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    end(known)


if __name__ == "__main__":
    # Ctrl-C or a SIGTERM to the driver's process group must not end the watchdog before the driver: the driver
    # shuts Ray down itself (and then closes the pipe), or dies, and either way the pipe says when to act.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch([int(pid) for pid in sys.argv[1:]])
