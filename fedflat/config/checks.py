"""Checking a config against what its names refer to: registered datasets, models, partitions, methods and upload
stages, and the combinations a method, the upload path, privacy and secure aggregation refuse.

Validation has no side effects: it imports no plugin and edits no environment. The registries are read as they stand,
so a config that names plugins is validated once they are imported (:func:`fedflat.config.load_config` and
:func:`fedflat.config.as_config`, which read a config for a run, import them first).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from fedflat import plugins
from fedflat.config.schema import CALLBACK_CONFIGS, LOGGER_CONFIGS, AlgoSpec, Config, PrivacyConfig, suggest
from fedflat.core.errors import ConfigError
from fedflat.privacy import check_upload_path


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, prefix + name + "."))
    return keys


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden" and e["loc"][0] in ("loggers", "callbacks") and len(e["loc"]) == 4:
            section, kind, option = e["loc"][0], e["loc"][2], str(e["loc"][3])
            valid = list((LOGGER_CONFIGS if section == "loggers" else CALLBACK_CONFIGS)[kind].model_fields)
            lines.append(f"{section}: unknown {kind} option '{option}'{suggest(option, valid)}; "
                         f"valid: {', '.join(valid)}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{suggest(key, _all_keys(Config))}")
        else:
            got = e.get("input")
            lines.append(f"{key or 'config'}: {e['msg']}" + (f" (got {got!r})" if not isinstance(got, dict) else ""))
    return "invalid config:\n  " + "\n  ".join(lines)


def validate(tree: dict[str, Any] | Config, method: AlgoSpec | None = None) -> Config:
    """Validates a raw tree (or re-validates a Config) including registry names and options; the method of a Config
    (or ``method``, one built before for the same section) is not built again. No side effects: the plugins the
    config names must be imported already (:func:`fedflat.config.load_config` does it), and an unknown name says so
    when they are not."""
    given = tree.algo if isinstance(tree, Config) else method
    if isinstance(tree, Config):
        tree = tree.model_dump()
    try:
        cfg = Config(**tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
    cfg.algo.adopt(given)  # already resolved: checked again only where the upload path changed
    try:
        cfg = _with_model_tokenizer(_with_recipe_privacy(cfg))
        _check_registered(cfg)
    except ConfigError as err:
        missing = plugins.not_imported(cfg.plugins)
        if not missing:
            raise
        raise ConfigError(f"{err} (plugins {', '.join(missing)} are not imported in this process: "
                          "fedflat.plugins.load(cfg.plugins) imports them, as load_config and as_config do)") from None
    return cfg


def _with_recipe_privacy(cfg: Config) -> Config:
    """A recipe that is a method under DP (DP-FedSAM) brings its ``privacy`` and ``compression`` sections where the
    config does not set them (``privacy: null`` sets it: the method without DP), and one of adapters (FFA-LoRA) its
    adapter options."""
    from fedflat.algorithms import RECIPES

    recipe = RECIPES.get(cfg.algo.name)
    if recipe is None:
        return cfg
    update: dict[str, Any] = {}
    given = cfg.model_fields_set
    if "privacy" not in given and recipe.privacy:
        update["privacy"] = PrivacyConfig(**recipe.privacy)
    if "compression" not in given and recipe.compression:
        update["compression"] = dict(recipe.compression)
    if recipe.adapter:
        update["adapter"] = _recipe_adapter(cfg, recipe)
    return cfg.model_copy(update=update) if update else cfg


def _with_model_tokenizer(cfg: Config) -> Config:
    """A dataset that tokenizes with a Hugging Face tokenizer (its ``tokenizer`` option: ``glue``) reads the model's
    own folder's where the model is one (``model=hf``) and the option is unset: the tokens the model was trained on."""
    from fedflat.data import DATASETS

    loader = DATASETS.get(cfg.data.name, (None,))[0]
    if (loader is None or "tokenizer" not in inspect.signature(loader).parameters or cfg.data.options.get("tokenizer")
            or cfg.model.get("name") != "hf" or not cfg.model.get("path")):
        return cfg
    data = cfg.data.model_copy(update={"options": {**cfg.data.options, "tokenizer": cfg.model["path"]}})
    return cfg.model_copy(update={"data": data})


def _recipe_adapter(cfg: Config, recipe) -> Any:
    """The ``adapter`` section with a recipe's adapter options (FFA-LoRA's ``freeze_a``) where the config leaves them
    unset; a config without adapters, or one setting them otherwise, is refused naming the option."""
    if cfg.adapter is None:
        raise ConfigError(f"algo={recipe.name} trains low-rank adapters: add an adapter section (e.g. adapter.r=8)")
    options = {}
    for key, value in recipe.adapter.items():
        if key in cfg.adapter.model_fields_set and getattr(cfg.adapter, key) != value:
            raise ConfigError(f"algo={recipe.name} sets adapter.{key}={value}; the config sets "
                              f"{getattr(cfg.adapter, key)}: leave it out")
        options[key] = value
    return cfg.adapter.model_copy(update=options)


def _check_options(where: str, fn: Callable, options: dict[str, Any], skip: tuple[str, ...],
                   also: tuple[str, ...] = ()) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n in params if n not in skip] + list(also)
    for key in options:
        if key not in valid:
            raise ConfigError(f"{where}.{key}: unknown option{suggest(key, valid)}; valid: {', '.join(valid) or '(none)'}")


def _check_data_options(name: str, options: dict[str, Any]) -> None:
    """The dataset loader's own options, and ``classes`` (every dataset's: :func:`fedflat.data.load_dataset`)."""
    from fedflat.data import DATASETS
    from fedflat.data.dataset import check_classes
    from fedflat.data.datasets import GENERIC_OPTIONS

    _check_options("data.options", DATASETS[name][0], {k: v for k, v in options.items() if k not in GENERIC_OPTIONS},
                   ("root", "download"), also=tuple(GENERIC_OPTIONS))
    if options.get("classes") is not None:
        check_classes(options["classes"])


def _check_name(where: str, name: str, registry: dict[str, Any]) -> None:
    if name not in registry:
        raise ConfigError(f"{where}: unknown name '{name}'{suggest(name, list(registry))}; "
                          f"allowed: {', '.join(sorted(registry))}")


def _check_registered(cfg: Config) -> None:
    from fedflat.data import DATASETS, PARTITIONS
    from fedflat.models import MODELS

    _check_name("data.name", cfg.data.name, DATASETS)
    _check_data_options(cfg.data.name, cfg.data.options)
    scheme = cfg.data.partition["scheme"]
    _check_name("data.partition.scheme", scheme, PARTITIONS)
    part_opts = {k: v for k, v in cfg.data.partition.items() if k != "scheme"}
    _check_options("data.partition", PARTITIONS[scheme][0], part_opts, ("labels", "num_clients", "seed", "rng"))
    model = cfg.model["name"]
    _check_name("model.name", model, MODELS)
    _check_options("model", MODELS[model][0], {k: v for k, v in cfg.model.items() if k not in ("name", "pretrained")},
                   ("input_shape", "num_classes"))
    if cfg.sampling.clients_per_round > cfg.data.num_clients:
        raise ConfigError(f"sampling.clients_per_round ({cfg.sampling.clients_per_round}) exceeds "
                          f"data.num_clients ({cfg.data.num_clients})")
    _check_section_kinds(cfg)
    _check_method(cfg)


def checked_key(cfg: Config) -> str:
    """What a method's check depends on: its section, the upload path's stages, privacy, sampling and secure
    aggregation."""
    return repr((cfg.algo.section(), cfg.stage_specs(calibrate=False), cfg.privacy, cfg.sampling,
                 cfg.secure_aggregation))


def _check_method(cfg: Config) -> None:
    """The method built once with the upload path (the noise multiplier not calibrated: ``z = 1`` stands in),
    checked against it, and its resolution kept in the spec (:meth:`AlgoSpec.remember`); a spec already checked
    with the same stages is not built again."""
    from fedflat.algorithms import AlgorithmError
    from fedflat.algorithms.compose import assemble, build_parts

    key = checked_key(cfg)
    if cfg.algo._checked == key:
        return
    try:
        method = cfg.algo._parts or build_parts(cfg.algo.section())
        algorithm = assemble(*method, cfg.stage_specs(calibrate=False))
    except AlgorithmError as err:
        raise ConfigError(str(err)) from None
    _check_robust(cfg, algorithm)
    _check_colluding(cfg, algorithm)
    check_upload_path(cfg.privacy, cfg.sampling.participation, algorithm)
    _check_secure_aggregation(cfg, algorithm)
    cfg.algo.remember(algorithm.resolved(), key, method)


def _check_section_kinds(cfg: Config) -> None:
    """``robust`` names a robust rule and ``attack`` an attack (stages of those kinds, docs/security.md)."""
    from fedflat.core import STAGES

    for section, kind in (("robust", "robust"), ("attack", "attack")):
        spec = getattr(cfg, section)
        if spec is None:
            continue
        allowed = sorted(n for n, cls in STAGES.items() if cls.kind == kind)
        name = spec.get("name")
        if name is None:
            raise ConfigError(f"{section}.name is missing: name one of {', '.join(allowed)}")
        if name not in allowed:
            raise ConfigError(f"{section}.name: {name!r} is not {'a robust rule' if kind == 'robust' else 'an attack'}"
                              f"{suggest(str(name), allowed)}; allowed: {', '.join(allowed)}")


def _check_robust(cfg: Config, algorithm) -> None:
    """A robust rule reads each client's own update: refused with central DP, whose noise is calibrated to the sum's
    sensitivity; a rule defined only for enough clients (Krum: 2 f + 2 < K) needs them sampled."""
    rules = [s for s in algorithm.path.stages if s.kind == "robust"]
    individual = [s for s in rules if s.individual]  # a rule that reads only the sum is post-processing of it
    if individual and cfg.privacy is not None and cfg.privacy.mode == "central":
        raise ConfigError(f"robust={individual[0].name} with privacy.mode=central: the server's noise is calibrated "
                          "to the sensitivity of the sum of clipped updates, and a robust rule reads each client's own "
                          "update; use privacy.mode=local, or drop one of them")
    for rule in algorithm.path.stages:
        if cfg.sampling.clients_per_round < rule.min_clients():
            raise ConfigError(f"{rule.kind}={rule.name} needs at least {rule.min_clients()} clients per round, "
                              f"sampling.clients_per_round is {cfg.sampling.clients_per_round}")


def _check_colluding(cfg: Config, algorithm) -> None:
    """A colluding attack (ALIE, IPM) forges its rows on the server side, after the clients' compression, DP clip
    and local noise, which its rows would skip (fedflat/algorithms/attacks.py): refused with them."""
    from fedflat.algorithms.attacks import Attack

    forged = [s for s in algorithm.path.stages if isinstance(s, Attack) and s.forges]
    if forged and (cfg.privacy is not None or algorithm.path.encoder is not None):
        raise ConfigError(f"attack={forged[0].name} forges the malicious uploads from the round's benign ones on the "
                          "server side, where they would skip the clients' compression and DP clip; drop privacy and "
                          "compression to run it")


def _check_secure_aggregation(cfg: Config, algorithm) -> None:
    """What SecAgg+ cannot give a method: each client's own upload (:attr:`fedflat.core.Part.individual`, a plugin's
    parts included), unequal weights (fedflat/flower/secagg.py), an encoded upload (indices and levels do not add up),
    central DP's sum of clipped updates (its noise would be added to the mean), more clients than the field holds
    (``K Q < M``)."""
    s = cfg.secure_aggregation
    if s is None:
        return
    needs = algorithm.individual_needs()
    if needs:
        raise ConfigError(f"secure_aggregation gives the server only the sum of the uploads, but "
                          f"{'; '.join(needs)}: this method needs what SecAgg+ hides; drop secure_aggregation or "
                          "use a method whose server reads only the mean (fedavg, fedsam, fedlesam, ...)")
    weighting = getattr(algorithm.parts["aggregation"].p, "weighting", "uniform")
    if weighting != "uniform":
        raise ConfigError(f"algo.weighting={weighting} with secure_aggregation: the server finishes the round from "
                          "the clients' mean, which is both the weighted mean and the sums the method reads only for "
                          "uniform weights (docs/flower.md); set algo.weighting=uniform")
    if algorithm.path.encoder is not None:
        raise ConfigError(f"compression ({algorithm.path.encoder.name}) with secure_aggregation: SecAgg+ sums dense "
                          "vectors, an encoded upload (indices, levels) cannot be summed; drop one of them")
    if cfg.privacy is not None and cfg.privacy.mode == "central":
        raise ConfigError("privacy.mode=central with secure_aggregation: the server's noise is calibrated to the sum "
                          "of clipped updates and SecAgg+ gives it their mean; use privacy.mode=local (each "
                          "client noises its update before SecAgg+ sums it)")
    if cfg.validation.max_norm is not None:
        raise ConfigError("validation.max_norm with secure_aggregation: the server sees only the clients' mean, not "
                          "each upload's norm; drop validation.max_norm (SecAgg+'s clipping_range bounds each value)")
    if cfg.sampling.clients_per_round * s.quantization_range >= s.modulus_range:
        raise ConfigError(f"secure_aggregation: {cfg.sampling.clients_per_round} clients per round of values up to "
                          f"quantization_range={s.quantization_range} overflow modulus_range={s.modulus_range}; "
                          "lower quantization_range or raise modulus_range (at most 2^32)")


def _signature_defaults(fn: Callable, skip: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in skip or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is p.empty:
            continue
        out[name] = list(p.default) if isinstance(p.default, tuple) else p.default
    return out


def resolve(cfg: Config) -> dict[str, Any]:
    """The config as a plain tree with every default filled in (what ``config.yaml`` holds); its plugins imported
    (a config from :func:`fedflat.config.load_config` or :func:`fedflat.config.as_config`)."""
    from fedflat.algorithms.compose import build_stages
    from fedflat.data import PARTITIONS
    from fedflat.models import MODELS

    tree = cfg.model_dump()
    tree["algo"] = cfg.algo.resolved()  # resolved when the config was loaded: the method is not built again
    if cfg.privacy is not None:  # the calibrated z: the run's files say what ran, and a resume need not search again
        tree["privacy"]["noise_multiplier"] = cfg.noise_multiplier()
    for section in ("compression", "robust", "attack"):  # every hyperparameter of the stage
        if getattr(cfg, section):
            stage = build_stages([getattr(cfg, section)])[0]
            tree[section] = {"name": stage.name, **stage.p.model_dump()}
    model_defaults = _signature_defaults(MODELS[cfg.model["name"]][0], ("input_shape", "num_classes"))
    tree["model"] = {"name": cfg.model["name"], **model_defaults, **{k: v for k, v in cfg.model.items() if k != "name"}}
    scheme = cfg.data.partition["scheme"]
    part_defaults = _signature_defaults(PARTITIONS[scheme][0], ("labels", "num_clients", "seed", "rng"))
    tree["data"]["partition"] = {"scheme": scheme, **part_defaults, **cfg.data.partition}
    return tree


