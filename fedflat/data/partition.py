"""Splitting a labelled training set among federated clients (IID and the usual non-IID schemes).

Every scheme returns one sorted int64 index array per client; a sample goes to at most one
client. All randomness comes from ``numpy.random.default_rng(seed)``: the same labels,
number of clients, scheme, parameters and seed always give the same split.
"""

from __future__ import annotations

import bisect
import inspect
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from fedflat.core import SERVER, ConfigError, stream_seed

__all__ = ["partition", "PARTITIONS", "label_counts", "plot_partition", "iid", "dirichlet",
           "dirichlet_balanced", "pathological", "shards", "natural", "domain", "user_split", "client_test_split"]

MAX_DIRICHLET_TRIES = 1000
MAX_DIRICHLET_SECONDS = 5.0  # redraws stop here too: a min_size out of reach is said in seconds, not minutes


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Sorted int64 copies of the per-client index arrays."""
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _class_indices(labels: np.ndarray) -> dict[int, np.ndarray]:
    """Indices of each class present in ``labels``."""
    return {int(k): np.flatnonzero(labels == k) for k in np.unique(labels)}


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle all samples and deal them out in near-equal parts (sizes differ by at most one)."""
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


def dirichlet(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, alpha: float,
              min_size: int = 10) -> list[np.ndarray]:
    """Per class, split its samples among clients in proportions ``~ Dir(alpha)``.

    The whole draw is repeated until every client holds at least ``min_size`` samples (at most
    :data:`MAX_DIRICHLET_TRIES` times and :data:`MAX_DIRICHLET_SECONDS`). Every sample is assigned.
    """
    _positive("dirichlet", "alpha", alpha)
    _int_at_least("dirichlet", "min_size", min_size, 0)
    if min_size * num_clients > len(labels):
        raise ValueError(f"dirichlet: min_size={min_size} x {num_clients} clients exceeds the "
                         f"{len(labels)} samples; lower min_size or num_clients")
    classes = _class_indices(labels)
    start, fewest = time.monotonic(), len(labels)
    for tries in range(1, MAX_DIRICHLET_TRIES + 1):
        draw = []  # per class: its members shuffled, and where the clients' shares end
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in classes.values():
            members = rng.permutation(members)
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            sizes += np.diff(cuts, prepend=0, append=len(members))
            draw.append((members, cuts))
        if sizes.min() >= min_size:  # the split itself only for the draw that is kept (the sizes decide)
            parts = zip(*(np.split(members, cuts) for members, cuts in draw))
            return _finish([np.concatenate(chunks) for chunks in parts])
        fewest = min(fewest, int((sizes < min_size).sum()))
        if time.monotonic() - start > MAX_DIRICHLET_SECONDS:
            break
    raise ValueError(f"dirichlet: no draw in {tries} ({time.monotonic() - start:.0f} s) gave every one of "
                     f"{num_clients} clients >= min_size={min_size} samples (alpha={alpha}; the best left {fewest} "
                     "short); lower min_size or raise alpha")


def dirichlet_balanced(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
                       alpha: float) -> list[np.ndarray]:
    """FL-Simulator's balanced Dirichlet split: equal client sizes, skewed class mixes.

    Every client gets ``floor(n / num_clients)`` samples and a class prior ``~ Dir(alpha)``.
    Samples are handed out one at a time in a random client order; each draw picks a class
    from the client's prior and takes an unused sample of it. When a class runs out, the
    priors are renormalized over the classes left (a client whose prior mass is all on
    exhausted classes draws in proportion to the samples left). The ``n mod num_clients``
    leftover samples are not assigned.
    """
    _positive("dirichlet_balanced", "alpha", alpha)
    classes = _class_indices(labels)
    members = [rng.permutation(m) for m in classes.values()]
    remaining = np.array([len(m) for m in members])
    priors = rng.dirichlet(np.full(len(members), float(alpha)), size=num_clients)
    order = rng.permutation(np.repeat(np.arange(num_clients), len(labels) // num_clients))
    draws = rng.random(len(order))
    picked = _draw_classes(order, draws, priors, remaining)
    sample = np.empty(len(order), dtype=np.int64)
    for k, pool in enumerate(members):
        steps = np.flatnonzero(picked == k)
        sample[steps] = pool[: len(steps)]
    by_client = sample[np.argsort(order, kind="stable")].reshape(num_clients, -1)
    return _finish(list(by_client))


def _draw_classes(order: np.ndarray, draws: np.ndarray, priors: np.ndarray,
                  remaining: np.ndarray) -> np.ndarray:
    """Class drawn at each step for client ``order[t]`` with uniform ``draws[t]``, without replacement.

    ``remaining`` (samples left per class) is decremented in place.
    """
    available = remaining > 0

    def cumulative() -> list[list[float]]:
        masked = priors * available
        empty = masked.sum(axis=1) <= 0
        masked[empty] = remaining * available  # prior mass all on exhausted classes
        return np.cumsum(masked, axis=1).tolist()

    cum, picked = cumulative(), np.empty(len(order), dtype=np.int64)
    for t, (client, u) in enumerate(zip(order.tolist(), draws.tolist())):
        row = cum[client]
        # first class whose cumulative mass exceeds u * total: never a zero-width (exhausted) class
        k = bisect.bisect_right(row, min(u * row[-1], math.nextafter(row[-1], 0.0)))
        picked[t] = k
        remaining[k] -= 1
        if remaining[k] == 0:
            available[k] = False
            cum = cumulative()
    return picked


def pathological(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
                 classes: int) -> list[np.ndarray]:
    """Every client holds exactly ``classes`` distinct classes (McMahan-style label skew).

    Classes are dealt round-robin over a seeded class permutation: the client in seeded slot
    ``i`` gets classes ``perm[(i * classes + j) mod C]``, ``j < classes``, so each class is
    held by ``floor`` or ``ceil(num_clients * classes / C)`` clients. Each class's samples are
    split evenly (sizes differ by at most one) among the clients holding it; a class held by
    nobody (only when ``num_clients * classes < C``) is left out.
    """
    by_class = _class_indices(labels)
    num_classes = len(by_class)
    _int_at_least("pathological", "classes", classes, 1)
    if classes > num_classes:
        raise ValueError(f"pathological: classes={classes} exceeds the {num_classes} classes in the labels; "
                         f"use 1 <= classes <= {num_classes}")
    class_perm = rng.permutation(list(by_class))
    slots = rng.permutation(num_clients)
    holders: dict[int, list[int]] = {k: [] for k in by_class}
    for client in range(num_clients):
        for j in range(classes):
            holders[int(class_perm[(slots[client] * classes + j) % num_classes])].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k, clients in holders.items():
        if clients:
            for client, chunk in zip(clients, np.array_split(rng.permutation(by_class[k]), len(clients))):
                parts[client].append(chunk)
    return _finish([np.concatenate(p) for p in parts])


def shards(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *,
           per_client: int) -> list[np.ndarray]:
    """McMahan's shards: sort by label, cut into ``num_clients * per_client`` near-equal shards,
    give every client ``per_client`` random shards. Every sample is assigned; within a class
    the sample order is shuffled first."""
    _int_at_least("shards", "per_client", per_client, 1)
    total = num_clients * per_client
    if total > len(labels):
        raise ValueError(f"shards: num_clients x per_client = {total} shards exceed the {len(labels)} samples")
    shuffled = rng.permutation(len(labels))
    by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
    pieces = np.array_split(by_label, total)
    owners = rng.permutation(total).reshape(num_clients, per_client)
    return _finish([np.concatenate([pieces[s] for s in row]) for row in owners])


def natural(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, fraction: float = 1.0,
            owners: list[int] | None = None) -> list[np.ndarray]:
    """LEAF's natural split: one client per owner of the samples (a writer, a speaking role), in ascending
    owner id. ``owners`` (one id per sample) comes from the dataset (:attr:`Dataset.owners`) unless given;
    ``fraction < 1`` keeps a random share of the owners, ``round(fraction * owners)``, as LEAF's ``--sf``.
    ``num_clients`` must be the number of owners kept."""
    if owners is None:
        raise ValueError("natural: this dataset has no natural owners (LEAF's femnist and shakespeare have: one "
                         "client per writer / role); choose another scheme, or pass clients= from Python")
    owners = np.asarray(owners).reshape(-1)
    if owners.shape[0] != len(labels):
        raise ValueError(f"natural: {owners.shape[0]} owners for {len(labels)} samples")
    if not 0 < fraction <= 1:
        raise ValueError(f"natural: fraction must be in (0, 1], got {fraction}")
    ids = every = np.unique(owners)
    kept = max(1, int(round(fraction * len(every))))
    if kept < len(every):
        ids = np.sort(rng.choice(every, kept, replace=False))
    if num_clients != len(ids):
        raise ValueError(f"the data have {len(every)} owners and fraction={fraction} keeps {len(ids)}: "
                         f"set data.num_clients={len(ids)}")
    order = np.argsort(owners, kind="stable")
    starts = np.searchsorted(owners[order], ids)
    ends = np.searchsorted(owners[order], ids, side="right")
    return _finish([order[a:b] for a, b in zip(starts, ends)])


def domain(labels: np.ndarray, num_clients: int, rng: np.random.Generator, *, per_domain: int = 1,
           fraction: float = 1.0, owners: list[int] | None = None) -> list[np.ndarray]:
    """The domain benchmarks' split (FedLESAM Table 3, FedWMSAM Table 2): each training domain (the samples'
    ``owners``, :attr:`Dataset.owners` of ``officehome`` / ``domainnet``) is shuffled, a ``fraction`` of it kept
    (FedWMSAM's "10% data sample rate": ``round(fraction * n_d)``, at least one per client) and dealt into
    ``per_domain`` near-equal clients. Clients are numbered domain by domain: client ``d * per_domain + j``.
    ``num_clients`` must be ``domains * per_domain``."""
    if owners is None:
        raise ValueError("domain: this dataset has no domains (officehome and domainnet have, and synthetic with "
                         "options.domains); choose another scheme")
    _int_at_least("domain", "per_domain", per_domain, 1)
    if not 0 < fraction <= 1:
        raise ValueError(f"domain: fraction must be in (0, 1], got {fraction}")
    owners = np.asarray(owners).reshape(-1)
    if owners.shape[0] != len(labels):
        raise ValueError(f"domain: {owners.shape[0]} owners for {len(labels)} samples")
    ids = np.unique(owners)
    if num_clients != len(ids) * per_domain:
        raise ValueError(f"the data have {len(ids)} training domains and per_domain={per_domain}: set "
                         f"data.num_clients={len(ids) * per_domain}")
    parts = []
    for d in ids:
        members = rng.permutation(np.flatnonzero(owners == d))
        kept = members[:max(per_domain, int(round(fraction * len(members))))]
        if len(kept) < per_domain:
            raise ValueError(f"domain: domain {d} has {len(members)} samples, fewer than per_domain={per_domain}")
        parts += np.array_split(kept, per_domain)
    return _finish(parts)


PARTITIONS: dict[str, tuple[Callable[..., list[np.ndarray]], str]] = {
    "iid": (iid, "uniformly random, near-equal sizes"),
    "dirichlet": (dirichlet, "per class, proportions ~ Dir(alpha) over clients; redraw until every "
                             "client has >= min_size (params: alpha, min_size=10)"),
    "dirichlet_balanced": (dirichlet_balanced, "FL-Simulator: equal sizes n/N, per-client class prior "
                                               "~ Dir(alpha) (params: alpha)"),
    "pathological": (pathological, "every client holds exactly `classes` classes, split evenly "
                                   "(params: classes)"),
    "shards": (shards, "sort by label, per_client random shards per client (McMahan) (params: per_client)"),
    "natural": (natural, "one client per owner of the data (LEAF's writers / roles); fraction samples a share "
                         "(params: fraction=1.0)"),
    "domain": (domain, "per_domain clients of each training domain (officehome, domainnet: leave-one-domain-out); "
                       "fraction keeps a share of each domain (params: per_domain=1, fraction=1.0)"),
}


def partition_params(scheme: str) -> dict[str, object]:
    """Parameters of ``scheme`` with their defaults (``inspect.Parameter.empty`` if required)."""
    params = inspect.signature(PARTITIONS[scheme][0]).parameters
    return {k: p.default for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def partition(labels: np.ndarray, num_clients: int, scheme: str, seed: int, **params) -> list[np.ndarray]:
    """Split the samples with ``labels`` among ``num_clients`` clients by ``scheme``, drawn with ``seed``.

    Returns per-client sorted int64 index arrays into ``labels``; no sample is in two clients.
    ``params`` are the scheme's (see :data:`PARTITIONS`); unknown or missing ones, or bad
    values, raise ``ValueError`` naming the parameter and what is allowed.
    """
    if scheme not in PARTITIONS:
        raise ValueError(f"unknown partition scheme {scheme!r}; available: {', '.join(PARTITIONS)}")
    labels = np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels).reshape(-1)
    _int_at_least("partition", "num_clients", num_clients, 1)
    if num_clients > len(labels):
        raise ValueError(f"partition: num_clients={num_clients} exceeds the {len(labels)} samples")
    _check_params(scheme, params)
    return PARTITIONS[scheme][0](labels, int(num_clients), np.random.default_rng(seed), **params)


def client_split(labels: np.ndarray, num_clients: int, spec: dict, run_seed: int,
                 dataset: str = "the dataset", owners: np.ndarray | None = None) -> list[np.ndarray]:
    """The split of a run's training samples (their ``labels``) among ``num_clients`` clients: ``spec`` is its
    ``data.partition`` (``scheme`` and the scheme's parameters), drawn from the keyed partition stream of the run's
    seed ``run_seed``, so every command that rebuilds a run's split gets the same one. ``owners`` (the dataset's)
    feed the ``natural`` and ``domain`` schemes. A split these data cannot give is a :class:`ConfigError` naming
    the key to change and ``dataset``."""
    params = {k: v for k, v in spec.items() if k != "scheme"}
    if spec["scheme"] in ("natural", "domain") and params.get("owners") is None:
        params["owners"] = owners
    try:
        return partition(labels, num_clients, spec["scheme"], seed=stream_seed(run_seed, -1, SERVER, "partition"),
                         **params)
    except ValueError as err:
        raise ConfigError(f"data.partition ({spec['scheme']} on {dataset}): {err}") from None


def user_split(clients, num_samples: int, num_clients: int) -> list[np.ndarray]:
    """A split the user gives (``fedflat.run(..., clients=[...])``): one sequence of training-sample indices
    per client, e.g. a natural split by writer or device. Checked: ``num_clients`` lists, every index in
    ``[0, num_samples)``, no sample in two clients, no empty client. Returns sorted int64 arrays."""
    parts = [np.asarray(c).reshape(-1) for c in clients]
    if len(parts) != num_clients:
        raise ConfigError(f"clients=: {len(parts)} clients given but data.num_clients={num_clients}")
    for i, part in enumerate(parts):
        if part.size == 0:
            raise ConfigError(f"clients=: client {i} has no samples; drop it or give it some")
        if not np.issubdtype(part.dtype, np.integer):
            raise ConfigError(f"clients=: client {i} holds {part.dtype} values; give integer sample indices")
        if part.min() < 0 or part.max() >= num_samples:
            raise ConfigError(f"clients=: client {i} has index {int(part.min() if part.min() < 0 else part.max())} "
                              f"outside the {num_samples} training samples")
    everything = np.concatenate(parts)
    if np.unique(everything).size != everything.size:
        counts = np.bincount(everything, minlength=num_samples)
        raise ConfigError(f"clients=: sample {int(np.argmax(counts > 1))} is given to more than one client (a "
                          "sample belongs to one client)")
    return _finish(parts)


def client_test_split(train_labels: np.ndarray, clients: list[np.ndarray], test_labels: np.ndarray, seed: int, *,
                      train_owners: np.ndarray | None = None, test_owners: np.ndarray | None = None
                      ) -> list[np.ndarray]:
    """Each client's share of the test set (its ``test_labels``), for a personalized evaluation (FedPer: every
    client is tested on data of its own distribution), from the training samples' ``train_labels`` and the split
    ``clients`` (index arrays into them). Returns sorted int64 test indices per client; a test sample goes to at
    most one client.

    - Owners on both splits (``train_owners``, ``test_owners``) and one owner per client (LEAF's natural split: a
      writer, a role): a client gets its owner's own test samples (LEAF's per-user test split).
    - Otherwise the test samples of each class, shuffled with ``seed``, are dealt out in proportion to the
      clients' training samples of that class (largest remainders round), so a client's test share follows its
      label distribution and every test sample of a class some client holds is used exactly once."""
    train_labels, test_labels = np.asarray(train_labels).reshape(-1), np.asarray(test_labels).reshape(-1)
    if train_owners is not None and test_owners is not None:
        owner = [np.unique(np.asarray(train_owners)[c]) for c in clients]
        if all(o.size == 1 for o in owner) and len({int(o[0]) for o in owner}) == len(owner):
            return _finish([np.flatnonzero(np.asarray(test_owners) == o[0]) for o in owner])
    num_classes = int(max(train_labels.max(initial=0), test_labels.max(initial=0))) + 1
    counts = label_counts(train_labels, clients, num_classes)
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in clients]
    for label, members in _class_indices(test_labels).items():
        held = counts[:, label]
        if held.sum() == 0:
            continue  # no client trains on this class: its test samples test nobody
        share = held / held.sum() * members.size
        quota = np.floor(share).astype(np.int64)
        quota[np.argsort(quota - share, kind="stable")[:members.size - quota.sum()]] += 1
        bounds = np.concatenate([[0], np.cumsum(quota)])
        members = rng.permutation(members)
        for i in np.flatnonzero(quota):
            parts[i].append(members[bounds[i]:bounds[i + 1]])
    return _finish([np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts])


def split_name(spec: dict) -> str:
    """``dirichlet-alpha0.1``: the partition ``spec`` (``scheme`` and its parameters), fit for a file name."""
    params = "-".join(f"{k}{v}" for k, v in sorted(spec.items()) if k != "scheme")
    return "-".join(p for p in (str(spec["scheme"]), params) if p).replace("/", "_").replace(" ", "")


def _check_params(scheme: str, params: dict[str, object]) -> None:
    valid = partition_params(scheme)
    described = ", ".join(k if v is inspect.Parameter.empty else f"{k}={v}" for k, v in valid.items()) or "none"
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"partition {scheme!r}: unknown parameter(s) {', '.join(unknown)}; valid: {described}")
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in params]
    if missing:
        raise ValueError(f"partition {scheme!r}: missing parameter(s) {', '.join(missing)}; valid: {described}")


def _positive(scheme: str, key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not value > 0:
        raise ValueError(f"{scheme}: {key} must be a number > 0, got {value!r}")


def _int_at_least(scheme: str, key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{scheme}: {key} must be an int >= {low}, got {value!r}")


def label_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Samples of each class held by each client: int64 array ``[clients, classes]`` of the samples' ``labels``
    over the split ``parts`` (one index array per client), for classes ``0 .. num_classes - 1``."""
    labels = np.asarray(labels).reshape(-1)
    return np.stack([np.bincount(labels[p], minlength=num_classes)[:num_classes] for p in parts]).astype(np.int64)


def plot_partition(counts: np.ndarray, path: str | Path, title: str | None = None) -> Path:
    """Write to ``path`` a heatmap PNG of ``counts`` (clients on x, classes on y) with a colorbar and ``title``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    counts = np.asarray(counts)
    clients, classes = counts.shape
    fig = Figure(figsize=(min(4 + 0.12 * clients, 16), min(2.5 + 0.15 * classes, 12)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(counts.T, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # clients and classes are whole numbers
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    sizes = counts.sum(axis=1)
    ax.set_title(title or f"{clients} clients x {classes} classes; samples per client "
                          f"{sizes.min()}-{sizes.max()} (mean {sizes.mean():.0f})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
