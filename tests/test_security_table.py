"""scripts/security_table.py, which pivots a sweep with attacks into docs/security.md's tables: each cell is the
mean ± sample std over seeds of the final evaluated round, by method, rule and attackers' fraction."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "security_table.py"
spec = importlib.util.spec_from_file_location("security_table", SCRIPT)
security_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(security_table)


def write_run(folder: Path, algo: str, robust: dict | None, fraction: float, lines: list[dict],
              status: str = "completed") -> None:
    """A run folder as fedflat writes it: config.yaml, metrics.jsonl, summary.json (only what the script reads)."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(
        {"algo": {"name": algo}, "robust": robust, "attack": {"name": "backdoor", "fraction": fraction}}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text(json.dumps({"status": status}))


def test_cells_are_the_mean_and_sample_std_of_each_seeds_last_evaluated_round(tmp_path, capsys):
    bound = {"name": "norm_bound", "bound": 0.5}
    # seeds 0 and 1 of FedAvg + norm bounding at 10%: the last evaluated round counts, not a later unevaluated one
    write_run(tmp_path / "s0", "fedavg", bound, 0.1, [{"round": 5, "test_acc": 0.1, "backdoor_acc": 0.9},
                                                     {"round": 10, "test_acc": 0.70, "backdoor_acc": 0.20},
                                                     {"round": 11, "train_loss": 1.0}])
    write_run(tmp_path / "s1", "fedavg", bound, 0.1, [{"round": 10, "test_acc": 0.74, "backdoor_acc": 0.40}])
    write_run(tmp_path / "s2", "fedsam", None, 0.0, [{"round": 10, "test_acc": 0.8, "backdoor_acc": 0.05}])
    write_run(tmp_path / "s3", "fedsam", None, 0.0, [{"round": 5, "test_acc": 0.3, "backdoor_acc": 0.0}],
              status="failed")  # left out, with a warning
    assert security_table.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "s3 did not complete" in err
    test, backdoor = out.split("Backdoor accuracy")
    # (70 + 74) / 2 = 72, sample std sqrt(2 * 2^2 / 1) = 2.83; (20 + 40) / 2 = 30, std sqrt(2 * 10^2) = 14.14
    assert "| FedAvg | norm_bound (M = 0.5) | — | 72.0 ± 2.8 |" in test
    assert "| FedAvg | norm_bound (M = 0.5) | — | 30.0 ± 14.1 |" in backdoor
    assert "| FedSAM | averaging | 80.0 (1 seed) | — |" in test
    assert "| method | rule | 0% attackers | 10% attackers |" in test


def test_a_folder_without_runs_says_what_to_do(tmp_path, capsys):
    assert security_table.main([str(tmp_path)]) == 2
    assert "no completed run" in capsys.readouterr().err
    assert security_table.main([str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
