"""scripts/attack_table.py, which pivots configs/security2_fmnist.yaml's sweep into docs/security.md's tables: each
cell is the mean ± sample std over seeds of the final evaluated round, by method and attack (rows) and rule
(columns); the backdoor table holds backdoor_acc of the runs under the backdoor."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "attack_table.py"
spec = importlib.util.spec_from_file_location("attack_table", SCRIPT)
attack_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(attack_table)


def write_run(folder: Path, algo: str, robust: dict | None, attack: dict | None, lines: list[dict],
              status: str = "completed") -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"algo": {"name": algo}, "robust": robust, "attack": attack}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text(json.dumps({"status": status}))


def test_cells_are_the_mean_and_sample_std_of_each_seeds_last_evaluated_round(tmp_path, capsys):
    alie, backdoor, krum = {"name": "alie", "fraction": 0.2}, {"name": "backdoor", "fraction": 0.2}, {"name": "krum"}
    write_run(tmp_path / "a0", "fedavg", krum, alie, [{"round": 10, "test_acc": 0.1},
                                                      {"round": 20, "test_acc": 0.70}, {"round": 21, "train_loss": 1}])
    write_run(tmp_path / "a1", "fedavg", krum, alie, [{"round": 20, "test_acc": 0.74}])
    write_run(tmp_path / "b0", "fedavg", None, backdoor, [{"round": 20, "test_acc": 0.8, "backdoor_acc": 0.9}])
    write_run(tmp_path / "b1", "fedavg", None, backdoor, [{"round": 20, "test_acc": 0.6, "backdoor_acc": 0.5}])
    write_run(tmp_path / "c0", "fedsam", None, None, [{"round": 20, "test_acc": 0.5}])
    write_run(tmp_path / "c1", "fedsam", None, None, [{"round": 5, "test_acc": 0.3}], status="failed")
    assert attack_table.main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "c1 did not complete" in err
    clean, backdoor_part = out.split("Backdoor accuracy")
    assert "| method, attack | mean | Krum |" in clean
    assert "| FedAvg, ALIE | — | 72.0 ± 2.8 |" in clean  # (70 + 74) / 2, sample std 2.83
    assert "| FedAvg, backdoor | 70.0 ± 14.1 | — |" in clean
    assert "| FedSAM, no attack | 50.0 (1 seed) | — |" in clean
    assert "| FedAvg | 70.0 ± 28.3 | — |" in backdoor_part  # backdoor_acc (90 + 50) / 2
    assert "(5 runs; 2 seeds" in out


def test_a_missing_folder_says_what_to_give(tmp_path, capsys):
    assert attack_table.main([str(tmp_path / "nowhere")]) == 2
    assert "give the sweep's out folder" in capsys.readouterr().err
