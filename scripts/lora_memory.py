"""Peak memory of federated LoRA on one machine: many clients of a RoBERTa-base-shaped model (random weights).

    python scripts/lora_memory.py                          # the table: FedAvg and SCAFFOLD, local and threads:2
    python scripts/lora_memory.py --clients 100 --algos scaffold --executors threads:2 --json mem.json

Each configuration runs in a fresh Python process (the peak resident set, ``ru_maxrss``, is a high-water mark of a
whole process): every client of ``--clients`` trains once (one round with all of them, ``--steps`` local steps of
``--batch`` sequences of ``--seq`` token ids), then the global model is evaluated. The process reports

- ``start``: its resident set after importing fedflat, torch, transformers and peft, before building anything;
- ``peak``: its peak resident set;
- ``base``: the frozen base's bytes (its parameters, float32), ``adapter``: one adapter vector's (the trained
  parameters: LoRA's ``A`` and ``B`` and the classifier head);
- ``uploads``: the bytes of the round's uploads (every client's adapters, and SCAFFOLD's ``c_i^+ - c_i``; the loss's
  scalar), ``state``: the new state rows the clients keep (SCAFFOLD's ``c_i^+``; nothing for FedAvg), which the
  round's commit copies into the client store, and ``kept``: the bytes the store holds after the round (in a
  later round, the ``c_i`` the new rows replace);
- ``bound``: ``base + uploads + state + kept``, one base model and the clients' adapter-sized vectors the method
  holds at the round's commit — what the run must hold (clients x base would be the model copied per client);
  ``strict``: ``base + uploads + kept``, without the new state rows;
- ``ratio``: ``(peak - start) / bound`` (the target: at most 1.3), and ``(peak - start) / strict``.

One more process is the reference, plain PyTorch + peft: it builds the adapted model (``built``: its resident set
over its start is what one base model costs in practice, transformers' construction included) and trains it one
step of the same batch (``step``: its peak over its start, the base and one step's activations, which every client's
step needs again). ``practical`` is ``built + W x (step - built) + uploads + state + kept``, ``W`` the steps that run
at once (1; ``threads:N``: N): the bound with what the model costs to build and each concurrent step's activations
in place of the bare parameters' bytes, with ``(peak - start) / practical``.

    python scripts/lora_memory.py --table mem.json         # the table again from a --json file
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 2 ** 20


def rss_bytes() -> int:
    """This process's resident set now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    """This process's peak resident set (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def overrides(folder: str, a: argparse.Namespace, algo: str, executor: str) -> list[str]:
    """The run: RoBERTa-base from ``folder``'s config.json, LoRA of rank ``a.r`` (the adapter section's default
    targets: query, key, value, dense; the classifier trained whole), every client in one round."""
    from fedflat.bench.measure import executor_overrides

    return ["seed=0", "rounds=1", "device=cpu", "threads=1", "engine=sequential", f"algo={algo}",
            "data.name=synthetic", f"data.num_clients={a.clients}", "data.partition=iid",
            f"data.options={{shape: [{a.seq}], num_classes: 2, tokens: 50265, train_size: {a.clients * a.batch}, "
            f"test_size: {a.batch}}}",
            "model=hf", f"model.path={folder}", "model.random_weights=true", f"adapter.r={a.r}",
            f"sampling.clients_per_round={a.clients}", f"train.batch_size={a.batch}", f"train.local_steps={a.steps}",
            f"eval.batch_size={a.batch}", *executor_overrides(executor)]


def write_model(folder: str) -> None:
    from fedflat.bench.workloads import ROBERTA_BASE

    Path(folder, "config.json").write_text(json.dumps(ROBERTA_BASE))


def one(a: argparse.Namespace) -> dict:
    """One configuration, in this process (``--one``)."""
    import peft  # noqa: F401 - imported before ``start``: the libraries are not the run's memory
    import torch
    import transformers  # noqa: F401

    from fedflat.config import load_config
    from fedflat.engine.simulation import Simulation
    from fedflat.models import assemble, build_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder)
        cfg = load_config(None, overrides(folder, a, *(("fedavg", "local") if a.reference else (a.algos, a.executors))))
        start = rss_bytes()
        if a.reference:  # the adapted model alone, then one step of plain PyTorch on it
            module = assemble(lambda: build_model("hf", (a.seq,), 2, path=folder, random_weights=True), 0, cfg.adapter)
            frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
            built = rss_bytes()
            trained = [p for p in module.parameters() if p.requires_grad]
            x, y = torch.randint(0, 50265, (a.batch, a.seq)), torch.randint(0, 2, (a.batch,))
            torch.nn.functional.cross_entropy(module(x), y).backward()
            torch.optim.SGD(trained, lr=0.01).step()
            return {"what": "reference", "start": start, "built": built, "peak": peak_bytes(), "base": 4 * frozen}
        sim = Simulation(cfg)
        seen: dict[str, int] = {}
        fit = sim.executor.fit

        def measured(*args):  # the round's result: what the clients uploaded and the state rows they keep
            result = fit(*args)
            seen["uploads"], seen["state"] = (sum(t.numel() * t.element_size() for t in entries.values())
                                              for entries in (result.upload, result.state))
            return result

        sim.executor.fit = measured
        try:
            sim.run_round(0)
            sim.evaluate()
            kept = sum(row.numel() * row.element_size() for rows in sim.server.store.state_dict().values()
                       for row in rows.values())
            module = sim.model.module
            base = sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)
            adapter = sim.num_parameters * 4
        finally:
            sim.close()
    return {"what": f"{a.algos}@{a.executors}", "start": start, "peak": peak_bytes(), "base": base,
            "adapter": adapter, "kept": kept, **seen, "clients": a.clients}


def table(rows: list[dict], a: argparse.Namespace) -> str:
    ref = next(r for r in rows if r["what"] == "reference")
    lines = [f"RoBERTa-base shape, LoRA r={a.r}, {a.clients} clients x {a.steps} step(s) of {a.batch} x {a.seq} "
             "token ids, one round; MB (2^20 bytes)",
             f"reference (plain PyTorch + peft): start {ref['start'] / MB:.0f}, built +{(ref['built'] - ref['start']) / MB:.0f}"
             f", one step's peak +{(ref['peak'] - ref['start']) / MB:.0f}; base (frozen parameters) {ref['base'] / MB:.0f}",
             f"{'run':<18} {'peak-start':>10} {'base':>6} {'adapter':>7} {'uploads':>7} {'state':>6} {'kept':>6} "
             f"{'bound':>6} {'ratio':>5} {'strict':>6} {'ratio':>5} {'practical':>9} {'ratio':>5}"]
    for r in rows:
        if r["what"] == "reference":
            continue
        grown = r["peak"] - r["start"]
        strict = r["base"] + r["uploads"] + r["kept"]
        bound = strict + r["state"]
        at_once = int(r["what"].split(":")[1]) if "threads:" in r["what"] else 1
        practical = ref["built"] - ref["start"] + at_once * (ref["peak"] - ref["built"]) + r["uploads"] + r["kept"] \
            + r["state"]
        lines.append(f"{r['what']:<18} {grown / MB:>10.0f} {r['base'] / MB:>6.0f} {r['adapter'] / MB:>7.2f} "
                     f"{r['uploads'] / MB:>7.0f} {r['state'] / MB:>6.0f} {r['kept'] / MB:>6.0f} {bound / MB:>6.0f} "
                     f"{grown / bound:>5.2f} {strict / MB:>6.0f} {grown / strict:>5.2f} {practical / MB:>9.0f} "
                     f"{grown / practical:>5.2f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--algos", default="fedavg,scaffold")
    p.add_argument("--executors", default="local,threads:2")
    p.add_argument("--json", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child: one configuration)
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--table", default=None, help="print the table of this --json file and stop")
    a = p.parse_args()
    if a.table:
        saved = json.loads(Path(a.table).read_text())
        print(table(saved["rows"], argparse.Namespace(**saved["settings"])))
        return
    if a.one:
        print(json.dumps(one(a)))
        return
    common = [f"--clients={a.clients}", f"--r={a.r}", f"--seq={a.seq}", f"--batch={a.batch}", f"--steps={a.steps}"]
    runs = [["--reference"]] + [[f"--algos={algo}", f"--executors={ex}"] for algo in a.algos.split(",")
                                for ex in a.executors.split(",")]
    rows = []
    for extra in runs:
        done = subprocess.run([sys.executable, __file__, "--one", *common, *extra], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(extra)} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{rows[-1]['what']}: peak {rows[-1]['peak'] / MB:.0f} MB", flush=True)
    print(table(rows, a))
    print(f"load average {os.getloadavg()}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "rows": rows, "load_average": os.getloadavg()},
                                           indent=2))


if __name__ == "__main__":
    main()
