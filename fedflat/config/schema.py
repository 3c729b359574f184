"""The config's schema: every section of a run's config as a pydantic model, the method's section
(:class:`AlgoSpec`) and the whole :class:`Config`.

Every key is checked: an unknown key is an error naming it and the closest valid key; a bad value names the key and
what is allowed. Building a :class:`Config` reads no registry, imports no plugin and edits no environment: what a
config's names refer to (datasets, models, partitions, methods, upload stages) is checked by
:mod:`fedflat.config.checks`.
"""
from __future__ import annotations

import copy
import difflib
import os
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from fedflat.privacy import Mechanism, PrivacyConfig, calibrated_noise, client_mechanism, dp_stage, delta_of


def suggest(word: str, options: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or nothing."""
    match = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    name: str = "digits"
    root: str | None = Field(None, description="folder searched first for dataset files")
    download: bool = Field(False, description="allow downloading from the official locations")
    options: dict[str, Any] = Field(default_factory=dict, description="dataset options (synthetic: shape, ...)")
    num_clients: int = Field(20, ge=1)
    partition: dict[str, Any] = Field(default_factory=lambda: {"scheme": "dirichlet", "alpha": 0.3, "min_size": 10})
    validation: float = Field(0.0, ge=0, lt=1, description="hold out this fraction of each class of the training "
                              "set and evaluate on it instead of the test set (model selection: `fedflat tune`)")


class TrainConfig(Section):
    """Local training: the SAM papers' shared setting by default (spec, 'Local training defaults')."""

    local_epochs: int = Field(5, ge=1)
    local_steps: int | None = Field(None, ge=1, description="fixed E_i instead of epochs")
    batch_size: int = Field(50, ge=1)
    lr: float = Field(0.1, gt=0, description="eta_l")
    lr_decay: float = Field(0.998, gt=0, le=1, description="eta_l^t = eta_l * lr_decay^t")
    weight_decay: float = Field(1e-3, ge=0, description="coupled: added to the gradient")
    clip: float | None = Field(10.0, gt=0, description="L2 clip of the local direction")
    clip_scope: Literal["loss", "step"] = Field(
        "loss", description="loss: clip the gradient of the loss with the method's linear terms, then add the weight "
                            "decay (and a proximal mu w) as the methods' public codes do (clip_grad_norm_ before "
                            "torch.optim.SGD's weight_decay); step: clip the whole local direction, decay included")
    global_lr: float = Field(1.0, gt=0, description="eta_g")
    # the local optimizer and schedule (fedflat/engine/optim.py, docs/experiments.md "Local optimizers")
    optimizer: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="the local step on the direction d: sgd (torch.optim.SGD), adam (L2 weight decay in d), "
                           "adamw (decoupled weight decay)")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD's momentum mu (0: plain SGD)")
    dampening: float = Field(0.0, ge=0, lt=1, description="SGD's dampening tau")
    nesterov: bool = Field(False, description="SGD's Nesterov momentum")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999], min_length=2, max_length=2,
                               description="Adam's (beta1, beta2)")
    eps: float = Field(1e-8, gt=0, description="Adam's epsilon")
    optimizer_state: Literal["round", "client"] = Field(
        "round", description="round: fresh every round (the papers' codes); client: kept per client as client state")
    schedule: Literal["exponential", "step", "cosine"] = Field(
        "exponential", description="eta_l^t per round after the warm-up: exponential (lr_decay^t), step "
                                   "(step_gamma every step_rounds), cosine (CosineAnnealingLR towards min_lr over the rounds)")
    warmup_rounds: int = Field(0, ge=0, description="linear warm-up eta_l (t + 1) / warmup_rounds first")
    step_rounds: int = Field(30, ge=1, description="schedule=step: rounds between decays")
    step_gamma: float = Field(0.1, gt=0, le=1, description="schedule=step: the decay factor")
    min_lr: float = Field(0.0, ge=0, description="schedule=cosine: eta_min, reached the round after the last")
    loss: Literal["cross_entropy", "focal"] = Field(
        "cross_entropy", description="the clients' loss (fedflat/engine/losses.py; the Python API's loss_fn takes "
                                     "any function (logits, y) -> per-sample losses)")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="loss=cross_entropy: label smoothing")
    focal_gamma: float = Field(2.0, ge=0, description="loss=focal: the focusing parameter gamma")

    @model_validator(mode="after")
    def _optimizer_options(self) -> "TrainConfig":
        if self.optimizer != "sgd" and (self.momentum or self.nesterov or self.dampening):
            raise ValueError(f"momentum/nesterov/dampening are SGD's; optimizer={self.optimizer} takes betas and eps")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0 (torch.optim.SGD's rule)")
        if self.optimizer_state == "client" and self.optimizer == "sgd" and self.momentum == 0:
            raise ValueError("optimizer_state=client: plain SGD keeps no state; set momentum or optimizer=adam/adamw")
        if self.label_smoothing and self.loss != "cross_entropy":
            raise ValueError(f"label_smoothing is cross_entropy's; loss={self.loss} takes its own options")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        return self


class SamplingConfig(Section):
    clients_per_round: int = Field(10, ge=1)
    participation: Literal["uniform", "bernoulli"] = "uniform"


class EvalConfig(Section):
    every: int = Field(1, ge=1, description="evaluate every this many rounds (and the last)")
    batch_size: int = Field(2000, ge=1)
    metrics: list[Literal["f1", "balanced_accuracy", "per_class_accuracy", "auroc"]] = Field(
        default_factory=list, description="torchmetrics beyond accuracy and loss on the held-out set, logged as "
                                          "test_<name> (fedflat/engine/scores.py)")


class StoreConfig(Section):
    """The client-state store (SCAFFOLD's c_i, FedDyn's h_i, ...): CPU memory up to a budget, then disk."""

    # int | float: a whole number stays one (config.yaml's 4096 read back and written again by a resume)
    memory_mb: int | float | None = Field(4096, ge=0, description="CPU-memory budget for client state (null: no "
                                                                  "limit); vectors beyond it spill to memory-mapped "
                                                                  "files")
    dir: str | None = Field(None, description="folder for spilled client state (default: a temp folder removed at exit)")


class ExecutorConfig(Section):
    """Where a round's clients train: in this process (``local``), on threads of this process (``threads``: every
    core of one machine on one run), or spread over Ray workers (``ray``), with the same results
    (docs/distributed.md)."""

    name: Literal["local", "threads", "ray"] = "local"
    workers: int = Field(2, ge=1, description="threads or Ray workers (Ray: long-lived actors, each with the data, "
                                              "model and engine)")
    address: str | None = Field(None, description="Ray cluster: null starts a local one; 'auto' joins the one "
                                                  "`ray start` made on this machine; or 'HOST:PORT'")
    cpus_per_worker: float | None = Field(None, gt=0, description="CPUs Ray reserves per worker (default: the "
                                                                   "cores divided among the workers)")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per worker; fractions share a GPU (0.5: two per GPU)")
    max_restarts: int = Field(1, ge=0, description="times a worker that died is replaced by a fresh one "
                                                   "(its clients are redone)")


DIAGNOSTIC_KINDS = ("sharpness", "flatness", "drift", "tracking", "spectra", "landscape", "tsne", "pca")


class DiagnosticsConfig(Section):
    """Flatness diagnostics (docs/diagnostics.md), recorded into RUN_DIR/diagnostics/ every ``every`` rounds;
    the same options drive ``fedflat analyze KIND RUN_DIR``. Subsets are seeded and fixed across rounds."""

    every: int = Field(0, ge=0, description="record every this many rounds (0: never)")
    kinds: list[Literal[DIAGNOSTIC_KINDS]] = Field(default_factory=lambda: ["sharpness", "flatness", "tracking"])
    samples: int | None = Field(1000, ge=1, description="training samples of the global objective (null: all)")
    clients: int | None = Field(10, ge=2, description="fixed subset of clients probed (null: all)")
    client_samples: int | None = Field(500, ge=1, description="samples of each probed client (null: all)")
    rho: float = Field(0.05, gt=0, description="radius of the global SAM sharpness and of direction=sam")
    direction: Literal["method", "sam"] = Field("method", description="clients' perturbations: the method's own "
                                                "(flatness, drift, pca) or local SAM")
    ascent_steps: int = Field(1, ge=1, description="projected ascent steps of the SAM sharpness")
    hessian_iters: int = Field(20, ge=0, description="power iterations for the top Hessian eigenvalue (0: skip)")
    reference_batches: int = Field(10, ge=1, description="IID batches of the tracking reference gradient")
    reference_batch_size: int = Field(512, ge=1)
    bands: int = Field(10, ge=2, description="frequency bands of the perturbation spectra")
    span: float = Field(1.0, gt=0, description="landscape half-width along each direction")
    resolution: int = Field(11, ge=3, description="landscape grid points per direction (cost: resolution^2 losses)")
    tsne_samples: int | None = Field(3000, ge=10, description="test samples embedded by t-SNE (null: all)")
    perplexity: float = Field(30.0, gt=0)
    layer: str | None = Field(None, description="parameter tensor of the PCA scatters (default: the first)")


class LoggerConfig(Section):
    """A logger of the run's config and metrics lines (docs/experiments.md, "Tracking runs");
    :mod:`fedflat.experiments.loggers` implements each ``name``."""

    name: str
    optional: bool = Field(False, description="a logger that cannot start (library missing, store unwritable) or "
                                              "fails later is a warning and the run goes on without it; otherwise "
                                              "one that cannot start stops the run before its first round")


class TensorBoardLogger(LoggerConfig):
    name: Literal["tensorboard"]


class CSVLogger(LoggerConfig):
    name: Literal["csv"]


class WandbLogger(LoggerConfig):
    name: Literal["wandb"]
    project: str = Field("fedflat", description="the W&B project")
    entity: str | None = Field(None, description="the W&B team or user (default: yours)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B's mode (default: W&B's own setting, $WANDB_MODE); offline keeps the run on disk "
                          "for `wandb sync`")
    dir: str | None = Field(None, description="where W&B writes its files (default: the run folder)")
    tags: list[str] = Field(default_factory=list)
    timeout: float = Field(30, gt=0, description="seconds W&B's requests may wait for its server (its service "
                                                 "process may take 3x this to start)")


class MLflowLogger(LoggerConfig):
    name: Literal["mlflow"]
    tracking_uri: str | None = Field(None, description="the tracking store, e.g. sqlite:///runs/mlflow.db "
                                                       "(default: $MLFLOW_TRACKING_URI, else MLflow's own)")
    experiment: str | None = Field(None, description="the MLflow experiment (default: the sweep's or tune "
                                                     "study's name, else 'fedflat')")
    tags: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(30, gt=0, description="seconds each request to an HTTP tracking server may wait to "
                                                 "connect and answer (tried 3 times: an unreachable one fails "
                                                 "within about 3x this)")


LOGGER_CONFIGS = {cls.model_fields["name"].annotation.__args__[0]: cls
                  for cls in (TensorBoardLogger, CSVLogger, WandbLogger, MLflowLogger)}
LoggerEntry = Annotated[Union[TensorBoardLogger, CSVLogger, WandbLogger, MLflowLogger], Field(discriminator="name")]


def _logger_entries(tree: dict[str, Any]) -> dict[str, Any]:
    """``loggers: [csv, {name: wandb, ...}]`` as mappings, each name known and given once; the old
    ``tensorboard: true`` adds the TensorBoard logger (``tensorboard: false`` is dropped)."""
    loggers = tree.get("loggers")
    loggers = [] if loggers is None else loggers
    if not isinstance(loggers, list):
        loggers = [loggers]
    entries = [{"name": e} if isinstance(e, str) else e for e in loggers]
    names = [e.get("name") for e in entries if isinstance(e, dict)]
    for name in names:
        if name is None:
            raise ValueError(f"loggers: an entry is a name or a mapping with a name ({', '.join(LOGGER_CONFIGS)})")
        if name not in LOGGER_CONFIGS:
            raise ValueError(f"loggers: unknown logger {name!r}{suggest(str(name), list(LOGGER_CONFIGS))}; "
                             f"allowed: {', '.join(LOGGER_CONFIGS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"loggers: {sorted({n for n in names if names.count(n) > 1})[0]!r} is given twice")
    if tree.get("tensorboard") and "tensorboard" not in names:
        entries.append({"name": "tensorboard"})
    tree = {k: v for k, v in tree.items() if k != "tensorboard"}
    return {**tree, "loggers": entries} if entries or "loggers" in tree else tree


class SecureAggregationConfig(Section):
    """Flower's SecAgg+ (Bell et al., CCS 2020) carries the uploads of a Flower run (docs/flower.md): the server learns
    only their sum. Each value is clipped to ``[-clipping_range, clipping_range]`` and stochastically
    quantized to ``quantization_range`` levels; sums are taken modulo ``modulus_range``."""

    num_shares: Union[Annotated[int, Field(gt=2)], Annotated[float, Field(gt=0, le=1)]] = Field(
        1.0, description="neighbours a node's secrets are shared with: a count (> 2), or a fraction of the round's "
                         "nodes (1.0: all, i.e. SecAgg)")
    reconstruction_threshold: Union[Annotated[int, Field(ge=2)], Annotated[float, Field(gt=0, le=1)]] = Field(
        0.5, description="shares that rebuild a node's secret: a count, or a fraction of num_shares; nodes may drop "
                         "out as long as every node keeps this many live neighbours")
    clipping_range: float = Field(8.0, gt=0, description="c: every uploaded value (the update Delta_i, not the "
                                                         "model) is clipped to [-c, c] before quantization")
    quantization_range: int = Field(2 ** 22, gt=0, description="Q: levels of the stochastic quantization; the "
                                                               "error of a node's value is below 2 c / Q")
    modulus_range: int = Field(2 ** 32, description="M: the field the masked sums live in, a power of 2, M > Q, "
                                                    "at most 2^32")
    timeout: float | None = Field(None, gt=0, description="seconds each of the protocol's four stages waits for "
                                                          "the nodes (default: the round timeout)")

    @model_validator(mode="after")
    def _flower_limits(self) -> "SecureAggregationConfig":
        M, Q = self.modulus_range, self.quantization_range
        if Q >= 2 ** 31:  # (the mod rounds to int32)
            raise ValueError(f"secure_aggregation.quantization_range={Q}: below 2^31 (Flower's SecAgg+ limits)")
        if M <= Q or M > 2 ** 32 or M & (M - 1):
            raise ValueError(f"secure_aggregation.modulus_range={M}: a power of 2 above quantization_range ({Q}) "
                             "and at most 2^32 (Flower's SecAgg+ limits)")
        shares, threshold = self.num_shares, self.reconstruction_threshold
        if isinstance(shares, int) and isinstance(threshold, int) and threshold >= shares:
            raise ValueError(f"secure_aggregation.reconstruction_threshold={threshold} must be below num_shares="
                             f"{shares}")
        return self


class AdapterConfig(Section):
    """The ``adapter`` section: the low-rank adapters (peft's LoRA or AdaLoRA) a run trains on its frozen model
    instead of every parameter (:mod:`fedflat.models.lora`, docs/models.md)."""

    method: Literal["lora", "adalora"] = Field("lora", description="lora (peft's LoraConfig) or adalora "
                                                                   "(AdaLoraConfig: the SVD form at init_r ranks)")
    r: int = Field(8, ge=1, description="the rank r of every adapter (AdaLoRA: its target_r)")
    alpha: float | None = Field(None, gt=0, description="lora_alpha: the update is scaled by alpha / r (default 2r, "
                                                        "FedSWA's and FedNSAM's)")
    dropout: float = Field(0.05, ge=0, lt=1, description="lora_dropout on the adapters' input")
    target_modules: list[str] | None = Field(None, description="modules adapted (peft's matching: a name or the end of "
                                                               "one); default: by model family (docs/models.md)")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="biases trained too (peft's bias)")
    modules_to_save: list[str] | None = Field(None, description="modules trained whole and federated (default: the "
                                                                "classifier head, head/classifier/score/fc; [] for "
                                                                "the adapters alone)")
    freeze_a: bool = Field(False, description="FFA-LoRA: A stays at its seeded random initialization, only B is "
                                              "trained and sent")
    init_r: int | None = Field(None, ge=1, description="adalora: the starting rank (default 2r)")
    init: str | None = Field(None, description="a peft adapter folder to start from (its settings define the "
                                               "adapter)")

    @model_validator(mode="after")
    def _consistent(self) -> "AdapterConfig":
        if self.method == "adalora" and self.freeze_a:
            raise ValueError("adapter.freeze_a is FFA-LoRA's (method=lora); AdaLoRA's P, E, Q are trained together")
        if self.init_r is not None and self.method != "adalora":
            raise ValueError("adapter.init_r is AdaLoRA's starting rank: set method=adalora or leave it out")
        return self


class CallbackConfig(Section):
    """A built-in callback of :mod:`fedflat.experiments.callbacks` (docs/experiments.md, "Stopping early")."""

    name: str
    metric: str = Field(description="the metrics line's key it watches, e.g. test_acc, val_loss")
    mode: Literal["min", "max"] | None = Field(None, description="max if the metric improves upward, min if "
                                                                 "downward (default: max for *_acc, min for *loss)")


class EarlyStoppingConfig(CallbackConfig):
    name: Literal["early_stopping"]
    patience: int = Field(3, ge=1, description="evaluations without improvement before the run stops")
    min_delta: float = Field(0.0, ge=0, description="the least change that counts as an improvement")


class ModelCheckpointConfig(CallbackConfig):
    name: Literal["model_checkpoint"]
    filename: str = Field("best_model.pt", description="the best model's file in the run folder")


CALLBACK_CONFIGS = {"early_stopping": EarlyStoppingConfig, "model_checkpoint": ModelCheckpointConfig}
CallbackEntry = Annotated[Union[EarlyStoppingConfig, ModelCheckpointConfig], Field(discriminator="name")]


def _callback_entries(tree: dict[str, Any]) -> dict[str, Any]:
    """``callbacks: [{name: early_stopping, metric: ...}, ...]``, each name known."""
    entries = tree.get("callbacks")
    if entries is None:
        return tree
    if not isinstance(entries, list):
        entries = [entries]
    for entry in entries:
        name = entry.get("name") if isinstance(entry, dict) else None
        if name not in CALLBACK_CONFIGS:
            raise ValueError(f"callbacks: unknown callback {name!r}{suggest(str(name), list(CALLBACK_CONFIGS))}; "
                             f"an entry is a mapping with a name: {', '.join(CALLBACK_CONFIGS)}")
    return {**tree, "callbacks": entries}


class ValidationConfig(Section):
    """What the server checks in every upload before the upload path's stages (docs/security.md)."""

    max_norm: float | None = Field(None, gt=0, description="reject an upload whose release (Delta_i and the other "
                                                           "entries, as one vector) has an L2 norm above this")
    invalid: Literal["reject", "fail"] = Field("reject", description="an upload with NaN/Inf or beyond max_norm: "
                                                                     "reject (the round goes on without it, a "
                                                                     "warning names the client) or fail (the run "
                                                                     "stops)")


class AlgoSpec(BaseModel):
    """The config's ``algo``: a method by ``name`` (a recipe, ``fedflat list``), and optionally another part in a
    role (``perturbation: asam``, or ``{name, **hyperparameters}``) and hyperparameters, flat (``rho: 0.1``: every
    part that has one) or under their role (``perturbation: {rho: 0.1}``).

    Resolved once: when the config is loaded (:func:`validate`) the method is built, checked against the upload
    path, and its parts and resolution kept (:meth:`resolved`: every part and hyperparameter under its role, what
    ``config.yaml`` records). A run's driver takes those parts with the run's upload stages (:meth:`build`, from
    :meth:`fedflat.engine.simulation.Simulation.build_algorithm`): the driver builds the method once, at the load;
    each Ray worker, thread worker or Flower node builds it once from the same section. It reads as the section's
    mapping (``spec["name"]``, ``dict(spec)``)."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    _resolved: dict[str, Any] | None = PrivateAttr(None)
    _checked: str | None = PrivateAttr(None)  # what it was checked with (checked_key): a re-validation skips the build
    _parts: tuple[str, dict[str, Any]] | None = PrivateAttr(None)  # the load's (name, parts), for the driver's run

    def section(self) -> dict[str, Any]:
        """The section as given: ``{name, **roles and hyperparameters}``."""
        return self.model_dump()

    def __getitem__(self, key: str) -> Any:
        return self.section()[key]

    def __iter__(self):  # the section's keys, as a mapping's (so ``dict(spec)`` is the section)
        return iter(self.section())

    def __len__(self) -> int:
        return len(self.section())

    def __contains__(self, key: object) -> bool:
        return key in self.section()

    def keys(self):
        return self.section().keys()

    def items(self):
        return self.section().items()

    def get(self, key: str, default: Any = None) -> Any:
        return self.section().get(key, default)

    def __eq__(self, other: object) -> bool:
        return self.section() == (other.section() if isinstance(other, AlgoSpec) else other)

    __hash__ = None  # type: ignore[assignment]  (a mutable mapping's)

    def resolved(self) -> dict[str, Any]:
        """Every part and hyperparameter of the method, each under its role (:meth:`Algorithm.resolved`): kept from
        the load's build, or (a spec never validated) built here once."""
        if self._resolved is None:
            from fedflat.algorithms import build_algorithm

            self._resolved = build_algorithm(self.section()).resolved()
        return copy.deepcopy(self._resolved)

    def build(self, stages: list[dict[str, Any]] | tuple = ()) -> Any:
        """The method (:class:`fedflat.algorithms.Algorithm`) with the upload ``stages``: the load's parts when this
        spec was validated (parts keep no state, so every run of the config may use them), else built here."""
        from fedflat.algorithms.compose import assemble, build_parts

        return assemble(*(self._parts or build_parts(self.section())), stages)

    def remember(self, resolved: dict[str, Any], key: str, parts: tuple[str, dict[str, Any]] | None = None) -> None:
        """Keeps the load's resolution, what the method was checked with (:func:`_check_method`) and its parts."""
        self._resolved, self._checked, self._parts = resolved, key, parts

    def adopt(self, other: "AlgoSpec | None") -> None:
        """Takes ``other``'s resolution and parts when it is the same section (a Config validated again)."""
        if other is not None and other.section() == self.section():
            self._resolved, self._checked, self._parts = other._resolved, other._checked, other._parts

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled without the load's parts (a plugin's classes may not import where it is unpickled: the other
        process builds the method from the section)."""
        state = super().__getstate__()
        private = state.get("__pydantic_private__")
        if private:
            state = {**state, "__pydantic_private__": {**private, "_parts": None}}
        return state


DEVICE_ENV = "FEDFLAT_DEVICE"  # the device of configs that name none (the tests' --device sets it)


class Config(Section):
    name: str | None = Field(None, description="a label for the run folder")
    plugins: list[str] = Field(default_factory=list, description="modules (or .py files, package folders) of your own "
                               "parts, recipes, models and datasets, imported before anything is built "
                               "(docs/extending.md)")
    seed: int = 0
    rounds: int = Field(100, ge=1)
    data: DataConfig = Field(default_factory=DataConfig)
    model: dict[str, Any] = Field(default_factory=lambda: {"name": "mlp"})
    adapter: AdapterConfig | None = Field(None, description="train low-rank adapters (LoRA, AdaLoRA: peft) on the "
                                                            "frozen model instead of every parameter; only they and "
                                                            "the head are federated (docs/models.md)")
    algo: AlgoSpec = Field(default_factory=lambda: AlgoSpec(name="fedavg"))
    train: TrainConfig = Field(default_factory=TrainConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    engine: Literal["auto", "sequential", "vectorized", "streams"] = Field(
        "auto", description="sequential (one client at a time), vectorized (a cohort's clients under torch.func.vmap), "
                            "streams (a cohort's clients side by side, each its own pass on a CUDA stream of its own) "
                            "or auto (docs/models.md, \"The streams engine\")")
    chunk_size: int | None = Field(None, ge=1, description="clients per vectorized chunk (auto from memory if unset)")
    device: str = Field(default_factory=lambda: os.environ.get(DEVICE_ENV, "cpu"),
                        description=f"cpu, cuda, cuda:N or auto (default: ${DEVICE_ENV}, else cpu)")
    tf32: bool = Field(False, description="on CUDA, matrix products and convolutions in TF32 (10-bit mantissa "
                                          "products, float32 sums): faster, about 1e-3 relative error per product")
    precision: Literal["float32", "bf16"] = Field(
        "float32", description="bf16: clients' forward and backward passes under torch.autocast in bfloat16 "
                               "(parameters, gradients, the methods' updates and evaluation stay float32)")
    channels_last: bool = Field(False, description="image batches in channels-last (NHWC) memory order for "
                                                   "the sequential engine's passes: cuDNN's tensor-core convolutions")
    cuda_graphs: bool = Field(False, description="on CUDA, each full batch's training pass (forward, backward) "
                                                 "recorded once per shape as a CUDA graph and replayed: removes "
                                                 "the kernel-launch cost that bounds mid-sized models")
    compile: bool = Field(False, description="each client's training pass (forward, backward) compiled by "
                                             "torch.compile: fused normalizations, casts and activations; "
                                             "engine sequential or streams, a module without per-client state; "
                                             "seconds to a minute of compiling at the first step")
    threads: Literal["auto"] | Annotated[int, Field(ge=1)] | None = Field(
        "auto", description="torch intra-op threads: auto (1 for small steps, else this process's share of the "
                            "cores; fedflat/engine/cores.py), a number, or null for torch's own choice")
    out: str = "runs"
    checkpoint_every: int = Field(10, ge=0, description="write checkpoint.pt every this many rounds "
                                  "(0: only at the end); `fedflat resume RUN_DIR` continues from it")
    privacy: PrivacyConfig | None = Field(None, description="client-level differential privacy (docs/privacy.md)")
    compression: dict[str, Any] | None = Field(None, description="compressed uploads: {name: topk, ratio, "
                                                                 "error_feedback} or {name: qsgd, levels, ...}")
    upload: list[dict[str, Any]] = Field(default_factory=list, description="further upload stages by name "
                                                                          "(a plugin's), each {name, ...}, run in "
                                                                          "this order after privacy, before robust")
    robust: dict[str, Any] | None = Field(None, description="robust aggregation: {name: median, trimmed_mean, "
                                                            "krum, bulyan, norm_bound or centered_clip, ...} "
                                                            "(docs/security.md)")
    attack: dict[str, Any] | None = Field(None, description="simulated malicious clients: {name: label_flip, "
                                                            "sign_flip, gaussian, backdoor, alie or ipm, ...} "
                                                            "(docs/security.md)")
    secure_aggregation: SecureAggregationConfig | None = Field(
        None, description="Flower runs: the uploads travel under Flower's SecAgg+, the server sees only their "
                          "sum (docs/flower.md)")
    validation: ValidationConfig = Field(default_factory=ValidationConfig,
                                         description="the server's checks of every upload (docs/security.md)")
    loggers: list[LoggerEntry] = Field(
        default_factory=list, description="where the config and metrics lines also go: tensorboard, csv, wandb, "
                                          "mlflow (names, or mappings with options); the old tensorboard: true "
                                          "adds tensorboard")
    callbacks: list[CallbackEntry] = Field(
        default_factory=list, description="built-in callbacks: early_stopping (metric, mode, patience, min_delta) "
                                          "and model_checkpoint (metric, mode, filename)")

    @model_validator(mode="before")
    @classmethod
    def _loggers(cls, data: Any) -> Any:
        return _callback_entries(_logger_entries(data)) if isinstance(data, dict) else data

    def privacy_mechanism(self) -> Mechanism | None:
        """The mechanism the accountant composes each round (:func:`fedflat.privacy.client_mechanism`), or None."""
        return client_mechanism(self.privacy, self.data.num_clients, self.sampling.clients_per_round,
                                self.sampling.participation)

    @property
    def privacy_delta(self) -> float:
        return delta_of(self.privacy, self.data.num_clients)

    def noise_multiplier(self) -> float:
        """``z``: the given one, or the one calibrated so that the run's ``rounds`` rounds spend ``target_epsilon``
        (:func:`fedflat.privacy.calibrated_noise`; local DP: its most-sampled client's releases)."""
        return calibrated_noise(self.privacy, self.privacy_mechanism(), self.rounds, self.privacy_delta, self.seed)

    def stage_specs(self, calibrate: bool = True) -> list[dict[str, Any]]:
        """The upload stages this config asks for, in the order they run: ``attack``, ``compression``, ``privacy``,
        the ``upload`` list in its order, then ``robust``, each ``{name, **hyperparameters}`` (the order is checked
        when the method is built: :func:`fedflat.algorithms.compose.order_problem`), the noise multiplier calibrated
        where ``privacy.target_epsilon`` asks (seconds of dp-accounting: with ``calibrate=False``, for checking the
        stages' shape only, ``z = 1`` stands in)."""
        specs = [dict(s) for s in (self.attack, self.compression) if s]
        p = self.privacy
        if p is not None and p.level == "client":
            z = self.noise_multiplier() if calibrate or p.noise_multiplier is not None else 1.0
            specs.append(dp_stage(p, self.sampling.clients_per_round, z))
        return specs + [dict(s) for s in self.upload] + ([dict(self.robust)] if self.robust else [])

    @model_validator(mode="after")
    def _named_sections(self) -> "Config":
        for section, name in (("model", self.model.get("name")), ("algo", self.algo.name)):
            if not isinstance(name, str):
                raise ValueError(f"{section}.name must be set to a name")
        if not isinstance(self.data.partition.get("scheme"), str):
            raise ValueError("data.partition.scheme must be set to a name")
        return self


