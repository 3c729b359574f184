"""The measuring side of ``fedflat bench`` (see :mod:`fedflat.bench`)."""
from __future__ import annotations

import os
import platform
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedflat.bench.bare import BARE_LOOPS, BareLoop, sync as _sync
from fedflat.config import Config, load_config
from fedflat.bench.workloads import ENGINES, WORKLOADS, Workload, prepare
from fedflat.engine import native
from fedflat.engine.cores import torch_threads

# ----------------------------------------------------------------------------- the machine

def matmul_flops(device: torch.device, n: int | None = None, seconds: float = 0.2, repeats: int = 5,
                 dtype: torch.dtype = torch.float32) -> float:
    """This machine's matmul FLOP/s in ``dtype``: the median of ``repeats`` windows of ``n x n`` products for about
    ``seconds`` each (n = 1024 on CPU, 8192 on a GPU, whose peak smaller products do not reach). The median, so
    that one window's burst or stall does not set ``%peak``'s reference: on the shared 2-core machine of
    docs/benchmarks.md single 0.2 s windows ranged from 100 to 150 GFLOP/s within a minute on an idle guest (the
    host's other tenants), while five windows' medians stayed within about 15%. On CUDA float32 products are TF32
    where ``torch.backends.cuda.matmul.allow_tf32`` is set."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    rates = []
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
            if device.type == "cuda" and count % 20:
                continue
            _sync(device)
        _sync(device)
        rates.append(2 * n ** 3 * count / (time.perf_counter() - start))
    return statistics.median(rates)


def machine(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on. ``matmul_flops`` is measured with torch's threads at the call (every
    core unless the caller set fewer): the machine's peak, which ``%peak`` refers to whatever threads a run uses."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "matmul_flops": matmul_flops(device), **_tensor_core_peaks(device), "native": native.status(),
            **kernels()}


FUSED_KERNELS = {"guided_point": "FedWMSAM's point", "mix_norm": "the momentum mix", "sam_point": "SAM's point",
                 "point_sum": "the point's sum", "remove_low_band": "FedFFT's band removal"}


def kernels() -> dict[str, Any]:
    """ATen's CPU dispatch level in this process (``ATEN_CPU_CAPABILITY`` forces one: default, avx2, avx512) and the
    fused native kernels the methods use (fedflat/engine/native: their own rounding, the same on every CPU), with
    whether ATen's torch expressions round FedWMSAM's point and the momentum mix alike at this level (then a run
    without them gives the same bits; SAM's point gives ATen's bits on every level, FedFFT's band removal is within
    the FFT's bound of scipy's)."""
    from fedflat.algorithms import fedwmsam
    from fedflat.core.vectors import kernel

    fused = [label for name, label in FUSED_KERNELS.items() if kernel(name) is not None]
    return {"aten_level": torch.backends.cpu.get_cpu_capability(),
            "aten_level_forced": os.environ.get("ATEN_CPU_CAPABILITY"), "fused_kernels": fused,
            "fused_round_as_aten": fedwmsam.rounds_as_kernels()}


def kernels_line(m: dict[str, Any]) -> str:
    """:func:`kernels` in one line for the table's head."""
    forced = f" (ATEN_CPU_CAPABILITY={m['aten_level_forced']})" if m.get("aten_level_forced") else ""
    fused = ", ".join(m.get("fused_kernels") or []) or "none (not built: the torch expressions run)"
    alike = {True: "; ATen's expressions round FedWMSAM's point and the mix alike here",
             False: "; ATen rounds FedWMSAM's point and the mix otherwise here", None: ""}[m.get("fused_round_as_aten")]
    return f"ATen dispatch {m.get('aten_level')}{forced}; fused kernels: {fused}{alike}"


def _tensor_core_peaks(device: torch.device) -> dict[str, float]:
    """On CUDA, also the tensor cores' TF32 and bfloat16 matmul rates (the peaks of runs with ``tf32=true``
    and ``precision=bf16``)."""
    if device.type != "cuda":
        return {}
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = matmul_flops(device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return {"matmul_flops_tf32": tf32, "matmul_flops_bf16": matmul_flops(device, dtype=torch.bfloat16)}


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated since the last reset, or the process's peak resident set on CPU
    (a high-water mark over the whole bench process)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- measuring

@dataclass
class Row:
    workload: str
    algo: str
    engine: str
    rounds: int
    seconds: list[float]
    cpu_seconds: list[float]
    samples_per_round: float
    backprops_per_step: float
    flops_per_round: float
    eval_seconds: float | None
    peak_memory_mb: float
    chunk_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    backprops_per_round: float | None = None  # measured: every backward pass of the timed rounds, extra passes too

    def summary(self, peak_flops: float) -> dict[str, Any]:
        median = statistics.median(self.seconds)
        return {"workload": self.workload, "algo": self.algo, "engine": self.engine, "rounds": self.rounds,
                "seconds_per_round": {"median": median, "min": min(self.seconds), "max": max(self.seconds)},
                "cpu_seconds_per_round": statistics.median(self.cpu_seconds),
                "samples_per_second": self.samples_per_round / median,
                "flops_per_round": self.flops_per_round, "flops_per_second": self.flops_per_round / median,
                "fraction_of_matmul_peak": self.flops_per_round / median / peak_flops,
                "backprops_per_step": self.backprops_per_step, "backprops_per_round": self.backprops_per_round,
                "eval_seconds": self.eval_seconds,
                "peak_memory_mb": self.peak_memory_mb, "chunk_size": self.chunk_size, **self.extra}


def flops_per_sample(sim) -> float:
    """FLOPs of one forward and backward pass per training sample (``FlopCounterMode``)."""
    x = sim.dataset.features(sim.dataset.x_train[: sim.cfg.train.batch_size])
    y = sim.dataset.y_train[: sim.cfg.train.batch_size]
    views = [v.detach().requires_grad_(True) for v in sim.model.layout.views(sim.server.w)]
    with FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(sim.model.call_views(views, x), y)
        torch.autograd.grad(loss, views)
    return counter.get_total_flops() / x.shape[0]


def round_samples(sim, round: int) -> int:
    """Training samples one round's local steps go through (per backprop): its batches' sizes."""
    ctx = sim.server.new_context(round)
    schedules = sim.batches.schedules(round, ctx.sampled.tolist(), ctx.steps.tolist())
    return sum(int(idx.shape[0]) for schedule in schedules for idx in schedule)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


class Contestant:
    """One (workload, method, engine) under test: a Simulation, or the bare loop on its clients."""

    def __init__(self, cfg: Config, workload: str, engine: str, bare_backprops: int = 1, rho: float = 0.01,
                 executor: str = "local"):
        from fedflat.engine.simulation import Simulation

        self.cfg, self.workload, self.engine, self.executor = cfg, workload, engine, executor
        self.sim = Simulation(cfg)
        if engine in BARE_LOOPS:
            bare = BareLoop(self.sim, bare_backprops, rho, plain=engine == "plain")
            self.runner, self.backprops = bare.run_round, float(bare_backprops)
            self.algo = f"{engine}-" + ("sgd" if bare_backprops == 1 else "sam")
        else:
            self.runner, self.backprops = self.sim.run_round, float(self.sim.algorithm.backprops_per_step)
            self.algo = cfg.algo["name"]
        self.seconds: list[float] = []
        self.cpu: list[float] = []
        self.samples: list[int] = []
        self.passes: list[int] = []  # backward passes of each timed round (the oracle's count; none for the bare loop)
        self.peak = 0.0

    def round(self, t: int, timed: bool) -> None:
        device = self.sim.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        before = self.sim.server.backprops
        with torch_threads(self.sim.report.threads):  # each contestant's own choice (threads are process-wide)
            wall, used = _timed(lambda: self.runner(t), device)
        self.peak = max(self.peak, peak_memory_mb(device))
        if timed:
            self.seconds.append(wall)
            self.cpu.append(used)
            self.samples.append(round_samples(self.sim, t))
            if self.engine not in BARE_LOOPS:
                self.passes.append(self.sim.server.backprops - before)

    def row(self) -> Row:
        eval_seconds = None if self.engine in BARE_LOOPS else _timed(self.sim.evaluate, self.sim.device)[0]
        per_round = statistics.mean(self.samples)
        cohort = self.engine in ("vectorized", "streams")
        chunk = self.sim.runtime.chunk_size(self.cfg.sampling.clients_per_round) if cohort else None
        spec = getattr(self.sim.executor, "spec", None)  # Ray workers: their own threads, not the driver's
        threads = spec.compute.threads if spec else self.sim.report.threads
        extra: dict[str, Any] = {"executor": self.executor, "threads": threads,
                                 "tf32": self.cfg.tf32 and self.sim.device.type == "cuda",
                                 "precision": "float32" if self.engine == "plain" else self.cfg.precision,
                                 "channels_last": self.cfg.channels_last and self.engine != "plain",
                                 "cuda_graphs": self.cfg.cuda_graphs, "compile": self.cfg.compile}
        if cohort and self.executor == "local":
            extra["oom_retries"] = self.sim.runtime.oom_retries  # chunks halved after a CUDA out-of-memory error
        if hasattr(self.sim.executor, "startup_seconds"):  # paid once per run, not in s/round
            extra["startup_seconds"] = self.sim.executor.startup_seconds  # the workers' start and data
            extra["ray_init_seconds"] = self.sim.executor.connect_seconds  # Ray itself (0 when already up)
        engine = self.engine if self.executor == "local" else f"{self.engine}@{self.executor}"
        return Row(self.workload, self.algo, engine, len(self.seconds), self.seconds, self.cpu, per_round,
                   self.backprops, flops_per_sample(self.sim) * per_round * self.backprops, eval_seconds,
                   self.peak, chunk_size=chunk, extra=extra,
                   backprops_per_round=statistics.mean(self.passes) if self.passes else None)


def race(contestants: list[Contestant], rounds: int, warmup: int,
         progress: Callable[[str], None] = lambda msg: None) -> None:
    """Runs every contestant's round ``t`` in turn (warm-up rounds untimed), so that a change of load
    on a shared machine hits all of them alike and their ratios stay meaningful."""
    start = time.perf_counter()
    for t in range(warmup + rounds):
        for c in contestants:
            c.round(t, timed=t >= warmup)
        kind = "warm-up" if t < warmup else "timed"
        progress(f"  round {t + 1}/{warmup + rounds} ({kind}) of every contestant done, "
                 f"{time.perf_counter() - start:.1f} s so far")


def profile_round(contestant: Contestant, t: int, folder: str) -> str:
    """Profiles round ``t`` of a contestant with ``torch.profiler`` (CPU, and CUDA kernels on a GPU) and
    writes the operators' table, sorted by device time on a GPU and by CPU time otherwise, to
    ``folder/<workload>-<algo>-<engine>.txt``; returns the path."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    device = contestant.sim.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_threads(contestant.sim.report.threads), profile(activities=activities) as prof:
        contestant.runner(t)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path = Path(folder) / f"{contestant.workload}-{contestant.algo}-{contestant.engine}.txt".replace("@", "-at-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=30))
    return str(path)


def busy_warning(load_average: list[float] | None, cores: int) -> str | None:
    """A warning when other jobs already load the machine (a load average over three quarters of the cores)."""
    if not load_average or load_average[0] <= 0.75 * cores:
        return None
    return (f"warning: the machine is busy (load average {load_average[0]:.1f} on {cores} cores): seconds will be "
            f"slow and noisy; the ratios stay comparable (rounds are interleaved). Default torch threads collapse "
            f"under load: consider --threads 1.")


def executor_overrides(executor: str) -> list[str]:
    """``local`` -> no override; ``threads:N`` -> N threads of this process; ``ray:N`` -> a Ray executor with N
    workers of one torch thread each.

    Contestants race one round at a time, so every contestant's workers stay up together: they reserve
    only a token share of a CPU from Ray (a reservation, not a limit), else the later ones could not start."""
    if executor == "local":
        return []
    name, _, workers = executor.partition(":")
    if name not in ("threads", "ray") or not workers.isdigit() or int(workers) < 1:
        raise ValueError(f"unknown executor {executor!r}: use local, threads:N or ray:N (N workers)")
    extra = ["executor.cpus_per_worker=0.01"] if name == "ray" else []
    return [f"executor={name}", f"executor.workers={workers}", *extra]


def bench(workloads: list[str], algos: list[str], engines: list[str], rounds: int, warmup: int = 1,
          device: str = "cpu", threads: int | None = None, overrides: tuple[str, ...] = (),
          progress: Callable[[str], None] = print, executors: tuple[str, ...] = ("local",),
          profile: str | None = None) -> dict[str, Any]:
    """Runs the bench and returns ``{"machine": ..., "results": [...]}`` with fedflat/bare ratios.

    ``executors``: ``local``, ``threads:N`` and/or ``ray:N``; every engine runs on each (the bare loop runs locally).
    ``profile``: a folder; one more round of every contestant is profiled there (:func:`profile_round`)."""
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise ValueError(f"unknown engine(s) {bad}; choose from {', '.join(ENGINES)}")
    from fedflat.engine.simulation import resolve_device

    dev = resolve_device(device)  # a clear error for cuda on a machine without one
    info = machine(dev)
    warning = busy_warning(info["load_average"], info["cpu_count"] or 1)
    if warning:
        progress(warning)
    results: list[dict[str, Any]] = []
    for name in workloads:
        with tempfile.TemporaryDirectory(prefix=f"fedflat-bench-{name}-") as folder:  # (W5's model: its config.json)
            results.extend(_bench_workload(WORKLOADS[name], folder, algos, engines, rounds, warmup, dev, info,
                                           [f"device={dev}", *([f"threads={threads}"] if threads else [])],
                                           overrides, progress, executors, profile))
        _add_ratios(results, name)
    if dev.type == "cpu":  # measured again after the rounds: a start slowed by the neighbours does not flatter %peak
        info["matmul_flops_start"] = info["matmul_flops"]
        info["matmul_flops"] = max(info["matmul_flops"], matmul_flops(dev))
        for r in results:
            if "flops_per_second" in r:
                r["fraction_of_matmul_peak"] = r["flops_per_second"] / info["matmul_flops"]
    return {"machine": info, "settings": {"workloads": workloads, "algos": algos, "engines": engines,
                                          "executors": list(executors),
                                          "rounds": rounds, "warmup": warmup, "threads": threads or "auto"},
            "workloads": {n: WORKLOADS[n].description for n in workloads}, "results": results}


def _bench_workload(w: Workload, folder: str, algos: list[str], engines: list[str], rounds: int, warmup: int,
                    dev: torch.device, info: dict[str, Any], settings: list[str], overrides: tuple[str, ...],
                    progress: Callable[[str], None], executors: tuple[str, ...],
                    profile: str | None) -> list[dict[str, Any]]:
    """The rows of one workload: every (method, engine, executor) and the bare loops, raced
    (:func:`bench`'s arguments; ``settings``: the device and threads overrides)."""
    from fedflat.algorithms import build_algorithm

    name, results = w.name, []
    n_rounds, n_warm = rounds, warmup
    if dev.type == "cpu" and w.cpu_rounds is not None:
        n_rounds, n_warm = min(rounds, w.cpu_rounds), min(warmup, w.cpu_warmup or 0)
    cpu = list(w.cpu_overrides) if dev.type == "cpu" else []
    base = [*settings, *prepare(w, folder), *cpu, *overrides]
    contestants: list[Contestant] = []
    bare_done: set[tuple[str, int]] = set()
    for algo in algos:
        for engine in engines:
            if engine in BARE_LOOPS:
                continue
            for executor in executors:
                cfg = load_config(None, [*base, f"algo={algo}", f"engine={engine}", *executor_overrides(executor)],
                                  base=w.tree)
                try:
                    contestants.append(Contestant(cfg, name, engine, executor=executor))
                except Exception as err:  # noqa: BLE001 - a refusal is a result of the bench
                    results.append({"workload": name, "algo": algo, "engine": engine, "executor": executor,
                                    "error": f"{type(err).__name__}: {err}"})
        algorithm = build_algorithm(load_config(None, [*base, f"algo={algo}"], base=w.tree).algo)
        bp = algorithm.backprops_per_step
        for loop in (e for e in BARE_LOOPS if e in engines and bp in (1, 2) and (e, bp) not in bare_done):
            bare_done.add((loop, bp))
            rho = float(algorithm.value("rho", 0.01))
            cfg = load_config(None, [*base, "engine=sequential"], base=w.tree)
            contestants.append(Contestant(cfg, name, loop, bp, rho))
    progress(f"{name}: {len(contestants)} contestants x {n_warm} warm-up + {n_rounds} timed rounds ...")
    try:
        race(contestants, n_rounds, n_warm, progress)
        rows = [_summary(c.row(), info) for c in contestants]
        for c in contestants if profile else ():
            progress(f"  profile: {profile_round(c, n_warm + n_rounds, profile)}")
    finally:
        for c in contestants:
            c.sim.close()
    return results + rows


def _summary(row: Row, info: dict[str, Any]) -> dict[str, Any]:
    """A row's summary, its FLOP/s against the matmul peak of its own precision (bfloat16, TF32 or float32;
    bfloat16 runs on a CPU are measured against the float32 peak, the only one measured there)."""
    if row.extra.get("precision") == "bf16" and "matmul_flops_bf16" in info:
        return row.summary(info["matmul_flops_bf16"])
    return row.summary(info["matmul_flops_tf32"] if row.extra.get("tf32") else info["matmul_flops"])


def _add_ratios(results: list[dict[str, Any]], workload: str) -> None:
    """``vs_bare`` (s/round over the bare loop with the same backprops per step; ``vs_bare_cpu`` the same of CPU
    seconds, what to read on a machine busy with other work; ``vs_plain_cpu`` likewise), ``vs_plain`` (over the plain loop: float32, NCHW,
    whatever options the run sets), ``vs_fedavg``, and
    ``backprops_vs_fedavg`` (backward passes a round over FedAvg's, the pilot and score passes included) with
    ``cost_per_backprop`` = ``vs_fedavg / backprops_vs_fedavg``: a method's time over what its backward passes
    alone would take at FedAvg's speed (1 when its other work is free)."""
    done = [r for r in results if r["workload"] == workload and "error" not in r]
    loops = {(r["engine"], round(r["backprops_per_step"])): r for r in done if r["engine"] in BARE_LOOPS}
    mine = [r for r in done if r["engine"] not in BARE_LOOPS]
    fedavg = {r["engine"]: r["seconds_per_round"]["median"] for r in mine if r["algo"] == "fedavg"}
    passes = {r["engine"]: r["backprops_per_round"] for r in mine if r["algo"] == "fedavg" and r.get("backprops_per_round")}
    for r in mine:
        s = r["seconds_per_round"]["median"]
        for loop in BARE_LOOPS:
            ref = loops.get((loop, round(r["backprops_per_step"])))
            if ref is not None:
                r[f"vs_{loop}"] = s / ref["seconds_per_round"]["median"]
                r[f"vs_{loop}_cpu"] = r["cpu_seconds_per_round"] / ref["cpu_seconds_per_round"]
        if r["engine"] in fedavg:
            r["vs_fedavg"] = s / fedavg[r["engine"]]
        if r["engine"] in passes and r.get("backprops_per_round"):
            r["backprops_vs_fedavg"] = r["backprops_per_round"] / passes[r["engine"]]
            if "vs_fedavg" in r:
                r["cost_per_backprop"] = r["vs_fedavg"] / r["backprops_vs_fedavg"]


def format_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"machine: {m['cpu']} ({m['cpu_count']} CPUs), {m['gpu'] or 'no GPU'}, torch {m['torch']}, "
             f"threads {report['settings']['threads']}, matmul {m['matmul_flops'] / 1e9:.0f} GFLOP/s"
             + (f" on {m['torch_threads']} threads (%peak's reference)" if m["device"] == "cpu" else "")
             + (f" ({m['matmul_flops_tf32'] / 1e9:.0f} in TF32)" if "matmul_flops_tf32" in m else "") + ", "
             f"load {m['load_average']}" + (f"\n{m['native']}" if m.get("native") else "")
             + (f"\n{kernels_line(m)}" if "aten_level" in m else "")]
    head = (f"{'workload':<8} {'algo':<12} {'engine':<18} {'thr':>3} {'s/round':>8} {'min':>7} {'max':>7} {'cpu s':>7} "
            f"{'eval s':>7} {'samples/s':>10} {'GFLOP/s':>8} {'%peak':>6} {'MB':>7} {'xbare':>6} {'cpu x':>6} "
            f"{'xplain':>6} {'xfedavg':>7} {'bp/round':>8} {'bp x':>5} {'x/bp':>5}")
    lines += [head, "-" * len(head)]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['workload']:<8} {r['algo']:<12} {r['engine']:<18} error: {r['error']}")
            continue
        s = r["seconds_per_round"]
        ev = f"{r['eval_seconds']:.3f}" if r.get("eval_seconds") is not None else "-"
        lines.append(
            f"{r['workload']:<8} {r['algo']:<12} {r['engine']:<18} {r.get('threads') or '-':>3} {s['median']:>8.3f} {s['min']:>7.3f} "
            f"{s['max']:>7.3f} {r['cpu_seconds_per_round']:>7.3f} {ev:>7} {r['samples_per_second']:>10.0f} "
            f"{r['flops_per_second'] / 1e9:>8.1f} {100 * r['fraction_of_matmul_peak']:>6.1f} "
            f"{r['peak_memory_mb']:>7.0f} {_fmt(r.get('vs_bare')):>6} {_fmt(r.get('vs_bare_cpu')):>6} "
            f"{_fmt(r.get('vs_plain')):>6} {_fmt(r.get('vs_fedavg')):>7} "
            f"{_count(r.get('backprops_per_round')):>8} {_fmt(r.get('backprops_vs_fedavg')):>5} "
            f"{_fmt(r.get('cost_per_backprop')):>5}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


# ----------------------------------------------------------------------------- the command
