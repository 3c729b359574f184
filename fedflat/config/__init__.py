"""Validated experiment configuration: YAML plus ``key=value`` overrides.

- :mod:`fedflat.config.schema`: every section as a pydantic model, and the whole :class:`Config`;
- :mod:`fedflat.config.checks`: what the config's names refer to, and the combinations refused
  (:func:`validate`, with no side effects), and :func:`resolve`, every default filled in so that ``config.yaml`` of a
  run reproduces it exactly;
- :mod:`fedflat.config.overrides`: a run's config from a file, its ``base:``, overrides, a tree or a Config
  (:func:`load_config`, :func:`as_config`: they import the config's plugins for the run, then validate); YAML as a
  researcher writes it, a file's kind, the shipped configs.

Importing this package stays free of torch (``fedflat --help`` loads none).
"""
from fedflat.config.checks import checked_key, resolve, validate
from fedflat.config.overrides import (_Loader,  # noqa: F401  (tests/test_loading.py checks every YAML load uses it)
                                      RESETTING, SECTION_IDS, SHORTHANDS, apply_override, as_config, base_file,
                                      config_file, deep_merge, dump_yaml, file_kind, inherited, load_config, located,
                                      packaged_config, packaged_configs, packaged_name, packaged_names, parse_override,
                                      quickstart_path, read_yaml, read_yaml_file, wrong_kind)
from fedflat.config.schema import (CALLBACK_CONFIGS, DEVICE_ENV, DIAGNOSTIC_KINDS, LOGGER_CONFIGS, AdapterConfig,
                                   AlgoSpec, CallbackConfig, CallbackEntry, Config, CSVLogger, DataConfig,
                                   DiagnosticsConfig, EarlyStoppingConfig, EvalConfig, ExecutorConfig, LoggerConfig,
                                   LoggerEntry, MLflowLogger, ModelCheckpointConfig, PrivacyConfig, SamplingConfig,
                                   SecureAggregationConfig, Section, StoreConfig, TensorBoardLogger, TrainConfig,
                                   ValidationConfig, WandbLogger, suggest)
from fedflat.core.errors import ConfigError

__all__ = [
    "CALLBACK_CONFIGS", "DEVICE_ENV", "DIAGNOSTIC_KINDS", "LOGGER_CONFIGS", "RESETTING", "SECTION_IDS", "SHORTHANDS",
    "AdapterConfig", "AlgoSpec", "CSVLogger", "CallbackConfig", "CallbackEntry", "Config", "ConfigError", "DataConfig",
    "DiagnosticsConfig", "EarlyStoppingConfig", "EvalConfig", "ExecutorConfig", "LoggerConfig", "LoggerEntry",
    "MLflowLogger", "ModelCheckpointConfig", "PrivacyConfig", "SamplingConfig", "SecureAggregationConfig", "Section",
    "StoreConfig", "TensorBoardLogger", "TrainConfig", "ValidationConfig", "WandbLogger", "apply_override",
    "as_config", "base_file", "checked_key", "config_file", "deep_merge", "dump_yaml", "file_kind", "inherited",
    "load_config", "located", "packaged_config", "packaged_configs", "packaged_name", "packaged_names",
    "parse_override", "quickstart_path", "read_yaml", "read_yaml_file", "resolve", "suggest", "validate",
    "wrong_kind",
]
