"""Config validation: unknown keys and bad values are errors that name the key and the fix."""
from __future__ import annotations

import pytest

from fedflat.config import load_config, parse_override, resolve
from fedflat.core import ConfigError


def test_defaults_are_the_spec_local_training_setting():
    cfg = load_config(None, [])
    t = cfg.train
    assert (t.local_epochs, t.batch_size, t.lr, t.lr_decay, t.weight_decay, t.clip, t.global_lr) == \
        (5, 50, 0.1, 0.998, 1e-3, 10.0, 1.0)


@pytest.mark.parametrize("override, fragment", [
    ("train.lr_rate=0.1", "unknown key 'train.lr_rate' (did you mean 'train.lr'?)"),
    ("rounds=abc", "rounds"),
    ("rounds=0", "rounds"),
    ("train.lr=-1", "train.lr"),
    ("sampling.participation=sometimes", "sampling.participation"),
    ("engine=turbo", "engine"),
    ("algo=fedsamm", "unknown algorithm 'fedsamm' (did you mean 'fedsam'?)"),
    ("algo.rh=0.1", "algo.rh: not a hyperparameter of 'fedavg'"),
    ("algo.perturbation=samm", "algo.perturbation: unknown perturbation 'samm' (did you mean 'sam'?)"),
    ("model=resnet19", "model.name: unknown name 'resnet19' (did you mean 'resnet18'?)"),
    ("model.hiden=[10]", "model.hiden: unknown option (did you mean 'hidden'?)"),
    ("data=fminst", "data.name: unknown name 'fminst' (did you mean 'fmnist'?)"),
    ("data.partition.alpa=0.1", "data.partition.alpa: unknown option (did you mean 'alpha'?)"),
    ("sampling.clients_per_round=50", "exceeds data.num_clients"),
])
def test_bad_config_names_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.num_clients=20", override])
    assert fragment in str(err.value)


def test_negative_radius_is_refused():
    with pytest.raises(ConfigError, match="algo.perturbation.rho: Input should be greater than or equal to 0"):
        load_config(None, ["algo=fedsam", "algo.rho=-0.1"])


def test_algo_shorthand_starts_from_the_recipe_defaults():
    cfg = load_config(None, ["algo=fedsam", "algo=fedavg"])
    assert cfg.algo == {"name": "fedavg"}  # the last choice of method wins
    for order in (["algo=fedsam", "algo.rho=0.05"], ["algo.rho=0.05", "algo=fedsam"]):
        assert resolve(load_config(None, order))["algo"]["perturbation"]["rho"] == 0.05  # options apply to the method
    with pytest.raises(ConfigError, match="algo.rho: not a hyperparameter of 'fedavg'"):
        load_config(None, ["algo=fedsam", "algo.rho=0.05", "algo=fedavg"])


def test_override_values_are_yaml():
    assert parse_override("model.hidden=[10, 20]") == ("model.hidden", [10, 20])
    assert parse_override("train.clip=null") == ("train.clip", None)
    assert parse_override("train.lr=1e-3") == ("train.lr", 1e-3)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("rounds")


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("rounds: 3\ntrain:\n  batchsize: 10\n")
    with pytest.raises(ConfigError, match="did you mean 'train.batch_size'"):
        load_config(typo)


def test_resolved_config_reloads_to_the_same_config(tmp_path):
    import yaml

    cfg = load_config(None, ["algo=fedsam", "data.partition=pathological", "data.partition.classes=2"])
    tree = resolve(cfg)
    assert tree["model"]["hidden"] == [200, 200] and tree["algo"]["perturbation"] == {"name": "sam", "rho": 0.01,
                                                                                        "warmup_rounds": 0}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert resolve(load_config(path)) == tree


def test_renaming_the_method_of_a_resolved_config_selects_that_methods_parts(tmp_path):
    """A run's config.yaml holds every role; `algo.name=X` on it must train X's own parts (roles given on
    the same command line still apply), never X's name over another method's parts."""
    from conftest import tiny_tree

    import fedflat
    from fedflat.algorithms import build_algorithm
    from fedflat.config import dump_yaml, resolve

    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(resolve(load_config(None, ["algo=fedsam"], base=tiny_tree()))))
    renamed = build_algorithm(load_config(path, ["algo.rho=0.2", "algo.name=fedvssam"]).algo)
    assert {r: p.name for r, p in renamed.parts.items()} == {"perturbation": "vssam", "filter": "none",
                                                            "correction": "vssam", "aggregation": "mean",
                                                            "server": "vssam", "personalization": "none"}
    assert renamed.parts["perturbation"].p.rho == 0.2  # order on the command line does not matter
    composed = load_config(path, ["algo.name=fedlesam", "algo.filter=fft", "rounds=1"])
    hist = fedflat.run(composed, save=False, progress=False)
    assert hist.summary["algorithm"] == "fedlesam[filter=fft]"  # reported as the composition it is
    same = load_config(path, ["algo.name=fedsam", "algo.rho=0.3"])  # the same name: the file's roles stay
    assert build_algorithm(same.algo).parts["perturbation"].p.rho == 0.3  # the command line wins over the file
    scoped = load_config(path, ["algo.perturbation.rho=0.4", "algo.perturbation=lesam"])  # a swap resets the role
    assert build_algorithm(scoped.algo).parts["perturbation"].p.rho == 0.4 and scoped.algo["perturbation"]["name"] == "lesam"
