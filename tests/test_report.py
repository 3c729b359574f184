"""Reports: numbers checked against run folders with known metrics, and the three formats parse."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
import yaml

from fedflat.config import load_config, resolve
from fedflat.experiments.plots import _slug, curve, setting_title, write_plots
from fedflat.experiments.report import ReportError, build_rows, find_runs, report, runs_at
from tests.conftest import tiny_tree

# (method, alpha, seed) -> test accuracy after rounds 1, 2, 3 and cumulative training seconds
RUNS = {
    ("fedavg", 0.3, 0): ([0.50, 0.70, 0.80], [1.0, 2.0, 3.0]),
    ("fedavg", 0.3, 1): ([0.60, 0.84, 0.84], [1.0, 2.0, 3.0]),
    ("fedsam", 0.3, 0): ([0.60, 0.86, 0.90], [2.0, 4.0, 6.0]),
    ("fedsam", 0.3, 1): ([0.60, 0.80, 0.90], [2.0, 4.0, 6.0]),
    ("fedavg", 1.0, 0): ([0.70, 0.90, 0.95], [1.0, 2.0, 3.0]),
}


def make_run(root: Path, method: str, alpha: float, seed: int, accs: list[float], secs: list[float]) -> Path:
    folder = root / f"{method}-a{alpha}-s{seed}"
    folder.mkdir(parents=True)
    overrides = [f"algo={method}", f"data.partition.alpha={alpha}", f"seed={seed}", "rounds=3"]
    (folder / "config.yaml").write_text(yaml.safe_dump(resolve(load_config(None, overrides, base=tiny_tree()))))
    lines = [{"round": t + 1, "test_acc": a, "train_seconds": s} for t, (a, s) in enumerate(zip(accs, secs))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    sam = method == "fedsam"
    summary = {"status": "completed", "rounds": 3, "final_test_acc": accs[-1], "best_test_acc": max(accs),
               "train_seconds": secs[-1], "up_vectors": 1, "down_vectors": 1, "backprops_per_step": 2 if sam else 1}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def runs_dir(tmp_path):
    for (method, alpha, seed), (accs, secs) in RUNS.items():
        make_run(tmp_path / "sweep", method, alpha, seed, accs, secs)
    return tmp_path / "sweep"


def test_rows_hold_mean_std_and_rounds_to_target(runs_dir):
    rows = {(r.setting, r.method): r for r in build_rows(find_runs([runs_dir]), [0.8, 0.82, 0.99])}
    assert set(rows) == {("alpha=0.3", "FedAvg"), ("alpha=0.3", "FedSAM"), ("alpha=1", "FedAvg")}
    avg = rows["alpha=0.3", "FedAvg"]
    assert avg.seeds == 2
    assert avg.final[0] == pytest.approx(82.0) and avg.final[1] == pytest.approx(math.sqrt(8))  # ddof=1
    assert avg.best[0] == pytest.approx(82.0)
    assert avg.targets[0.8] == (2.5, 2.5, 2)  # rounds 3 and 2, at 3.0 s and 2.0 s
    assert avg.targets[0.82] == (2.0, 2.0, 1)  # only seed 1 got there
    assert avg.targets[0.99] == (None, None, 0)
    assert avg.sec_per_round == pytest.approx(1.0) and avg.backprops == 1 and avg.comm == 1
    sam = rows["alpha=0.3", "FedSAM"]
    assert sam.final == (pytest.approx(90.0), pytest.approx(0.0))
    assert sam.targets[0.8] == (2.0, 4.0, 2) and sam.targets[0.82] == (2.5, 5.0, 2)
    assert sam.backprops == 2 and sam.sec_per_round == pytest.approx(2.0)
    single = rows["alpha=1", "FedAvg"]
    assert single.final == (pytest.approx(95.0), None)


def _markdown_table(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("|")]  # (the caption follows the table)
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "")) == {"-"}
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in lines[2:]]


def test_markdown_parses_with_paper_style_cells(runs_dir):
    table = _markdown_table(report([runs_dir], [0.82, 0.99], "markdown"))
    rows = {(r["setting"], r["method"]): r for r in table}
    avg = rows["alpha=0.3", "FedAvg"]
    assert avg["final acc (%)"] == "82.00 ± 2.83"
    assert avg["rounds to 82%"] == "2 (1/2)" and avg["time to 82% (s)"] == "2.0"
    assert avg["rounds to 99%"] == "–" and avg["time to 99% (s)"] == "–"
    assert rows["alpha=0.3", "FedSAM"]["rounds to 82%"] == "2.5"
    assert rows["alpha=1", "FedAvg"]["final acc (%)"] == "95.00"  # one seed: no ± part
    assert rows["alpha=0.3", "FedSAM"]["backprops/step"] == "2"
    assert [r["method"] for r in table[:2]] == ["FedAvg", "FedSAM"]  # FedAvg first within a setting


def test_csv_parses_to_the_numbers(runs_dir):
    rows = list(csv.DictReader(io.StringIO(report([runs_dir], [0.8], "csv"))))
    sam = next(r for r in rows if r["method"] == "FedSAM")
    assert float(sam["final_acc_mean"]) == pytest.approx(90.0) and float(sam["final_acc_std"]) == 0.0
    assert float(sam["rounds_to_0.8"]) == 2.0 and sam["reached_0.8"] == "2"
    single = next(r for r in rows if r["setting"] == "alpha=1")
    assert single["final_acc_std"] == ""  # undefined for one seed, not zero


def test_latex_is_a_well_formed_tabular(runs_dir):
    text = report([runs_dir], [0.99], "latex")
    lines = text.strip().splitlines()
    assert lines[0].startswith(r"\begin{tabular}{") and lines[-2] == r"\end{tabular}"
    assert lines[-1].startswith(r"\par\smallskip{\footnotesize Seeds 0, 1 (") and "$\\pm$" in lines[-1]
    columns = len(lines[0][len(r"\begin{tabular}{"):-1])
    body = lines[lines.index(r"\midrule") + 1: lines.index(r"\bottomrule")]
    assert len(body) == 3
    for line in [lines[2], *body]:
        assert line.endswith(r"\\") and len(line[:-2].split(" & ")) == columns
        assert line.count("$") % 2 == 0
    assert r"$82.00 \pm 2.83$" in text and " -- " in text and r"\%" in lines[2]
    assert "–" not in text and "±" not in text  # plain ASCII LaTeX


def test_every_table_states_its_seeds_and_what_one_held_out_sample_is_worth(tmp_path):
    """The demo's table gave no hint that it was one seed on 359 test images, where one image is 0.28 points."""
    for method in ("fedavg", "fedsam"):
        folder = make_run(tmp_path / "one", method, 0.3, 0, [0.5, 0.8, 0.9], [1.0, 2.0, 3.0])
        summary = json.loads((folder / "summary.json").read_text())
        summary.update(dataset="digits", test_samples=359, num_classes=10, evaluated_on="test")
        (folder / "summary.json").write_text(json.dumps(summary))
    text = report([tmp_path / "one"], [], "markdown")
    assert text.endswith("\n\nSeed 0 (one run per row, so no spread is shown). Held out: 359 test samples (digits): "
                         "one is 0.28 points of accuracy.\n")
    rows = list(csv.DictReader(io.StringIO(report([tmp_path / "one"], [], "csv"))))
    assert [(r["seed_values"], r["heldout_samples"]) for r in rows] == [("0", "digits:test:359")] * 2
    # three seeds, 10,000 test images and a validation split of 6,000; runs that did not record their sizes
    rows = build_rows(find_runs([tmp_path / "one"]), [])
    for row, seeds in zip(rows, [(0, 1, 2), (0, 1, 2)]):
        row.seed_values, row.seeds = seeds, 3
        row.heldout = (("fmnist", "test", 10_000), ("fmnist", "val", 6_000))
    from fedflat.experiments.report import caption
    assert caption(rows) == ("Seeds 0, 1, 2 (3 runs per row: mean ± sample standard deviation). Held out: 10,000 test "
                             "samples (fmnist): one is 0.01 points of accuracy; 6,000 validation samples (fmnist): "
                             "one is 0.017 points of accuracy.")
    rows[1].seed_values = (2, 10, 1)  # (numeric order: 2 before 10)
    assert caption(rows).startswith("Seeds 0, 1, 2, 10 (3 runs per row")
    rows[0].heldout = rows[1].heldout = ()
    rows[0].seed_values, rows[1].seed_values = tuple(range(10)), (0, 1, 2)
    assert caption(rows) == ("Seeds 0-9 (3 runs per row: mean ± sample standard deviation). The runs did not record "
                             "their held-out sizes (written by an older fedflat).")


def test_a_run_at_chance_shows_so_in_the_status_column(tmp_path):
    """A collapsed run (final accuracy at chance level) showed status "ok"."""
    for seed, final in ((0, 0.11), (1, 0.80)):  # 0.11 is within 3 standard errors of 1/10 on 359 samples (0.048)
        folder = make_run(tmp_path / "runs", "fedavg", 0.3, seed, [0.5, 0.6, final], [1.0, 2.0, 3.0])
        summary = json.loads((folder / "summary.json").read_text())
        summary.update(test_samples=359, num_classes=10)
        (folder / "summary.json").write_text(json.dumps(summary))
    (row,) = _markdown_table(report([tmp_path / "runs"], [], "markdown"))
    assert row["status"] == "at chance 1/2"
    (tmp_path / "runs" / "fedavg-a0.3-s0").rename(tmp_path / "fedavg-a0.3-s0")
    (row,) = _markdown_table(report([tmp_path / "runs"], [], "markdown"))
    assert row["status"] == "ok"


def test_plots_are_written_and_curves_average_seeds(runs_dir, tmp_path):
    runs = [r for r in find_runs([runs_dir]) if r.config["algo.name"] == "fedavg" and r.config["data.partition.alpha"] == 0.3]
    rounds, mean, std = curve(runs)
    assert rounds.tolist() == [1, 2, 3]
    assert mean.tolist() == pytest.approx([0.55, 0.77, 0.82])
    assert std[0] == pytest.approx(math.sqrt(0.005))
    written = write_plots(find_runs([runs_dir]), tmp_path / "plots", formats=["png"])
    names = sorted(p.name for p in written)
    assert names == ["convergence-alpha0.3.png", "convergence-alpha1.png", "partition-alpha0.3.png",
                     "partition-alpha1.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_csv_gives_each_convergence_figure_its_numbers(runs_dir, tmp_path):
    """``--formats png,csv``: beside each convergence figure its curves, the mean and std the figure draws (the
    fedavg runs at alpha 0.3 hold accuracies 0.5/0.6 in round 1: mean 0.55, std sqrt(0.005)); a split has no CSV."""
    runs = [r for r in find_runs([runs_dir]) if r.config["data.partition.alpha"] == 0.3]
    written = write_plots(runs, tmp_path / "plots", formats=["csv"])
    assert [p.name for p in written] == ["convergence-all.csv"]
    lines = written[0].read_text().splitlines()
    assert lines[0] == "method,runs,round,test_acc_mean,test_acc_std"
    fedavg = [line.split(",") for line in lines[1:] if line.startswith("FedAvg,")]
    assert [row[2] for row in fedavg] == ["1", "2", "3"] and fedavg[0][1] == "2"
    assert float(fedavg[0][3]) == pytest.approx(0.55) and float(fedavg[0][4]) == pytest.approx(math.sqrt(0.005))


def test_figures_come_in_png_pdf_and_svg_one_column_wide_in_a_colour_blind_safe_palette(runs_dir, tmp_path):
    from fedflat.experiments.plots import COLUMN_WIDTH, OKABE_ITO
    from fedflat.metrics.plots import png_size

    runs = [r for r in find_runs([runs_dir]) if r.config["data.partition.alpha"] == 0.3]
    written = write_plots(runs, tmp_path / "plots", dpi=100)
    assert sorted(p.name for p in written) == sorted(f"{stem}.{fmt}" for stem in ("convergence-all",
                                                     "partition-all") for fmt in ("png", "pdf", "svg"))
    folder = tmp_path / "plots"
    assert (folder / "convergence-all.pdf").read_bytes()[:5] == b"%PDF-"
    svg = (folder / "convergence-all.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert png_size(folder / "convergence-all.png")[0] == round(COLUMN_WIDTH * 100)  # 3.5 in at 100 dpi
    # fedavg and fedsam in the palette's first two colours, each band edged in its method's colour and dashes
    assert OKABE_ITO[0] in svg.upper() and OKABE_ITO[1] in svg.upper()
    assert "test accuracy (%)" in svg and "FedSAM (n=2)" in svg  # text stays text: editable in a paper


def test_no_blank_plot_for_a_setting_that_never_evaluated_and_file_names_stay_short(tmp_path, capsys):
    make_run(tmp_path / "runs", "fedavg", 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
    dead = make_run(tmp_path / "runs", "fedsam", 0.3, 0, [0.5], [1.0])
    (dead / "metrics.jsonl").write_text("")  # diverged in round 1: nothing evaluated
    lonely = make_run(tmp_path / "runs", "fedavg", 1.0, 0, [0.5], [1.0])
    (lonely / "metrics.jsonl").write_text("")
    written = write_plots(find_runs([tmp_path / "runs"]), tmp_path / "plots", formats=["png"])
    assert sorted(p.name for p in written if p.name.startswith("convergence")) == ["convergence-alpha0.3.png"]
    assert "no convergence plot for 'alpha=1': no run has an evaluated round" in capsys.readouterr().out
    long = " ".join(f"train.option_number_{i}={i}" for i in range(12))
    assert len(_slug(long)) <= 69 and _slug(long) != _slug(long + " x=1") and "=" not in _slug(long)


def test_a_figure_of_the_only_setting_says_what_the_setting_is():
    """A report of one setting labels it "all", and its convergence figure was titled "digits: all" (issue 32)."""
    config = {"data.name": "digits", "data.num_clients": 20, "data.partition.scheme": "dirichlet",
              "data.partition.alpha": 0.3, "data.partition.min_size": 10, "sampling.clients_per_round": 10}
    assert setting_title(config, "all") == "digits: 20 clients, dirichlet (alpha 0.3), 10 per round"
    assert setting_title(config, "alpha=0.1") == "digits: alpha=0.1"  # several settings: what tells them apart


def test_report_errors(tmp_path, runs_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no run folders"):
        report([tmp_path / "empty"], [])
    with pytest.raises(ReportError, match="no such folder"):
        report([tmp_path / "missing"], [])
    with pytest.raises(ReportError, match="fractions"):
        report([runs_dir], [75])
    with pytest.raises(ReportError, match="--format"):
        report([runs_dir], [], "html")


def test_at_round_reports_the_runs_as_they_stood_then(runs_dir, tmp_path, capsys):
    """``--at-round 2``: final accuracy at round 2, best up to it, rounds to target and s/round within it; a
    run extended to 4 rounds groups with the 3-round runs; a run that never evaluated round 2 is left out."""
    longer = make_run(tmp_path / "sweep", "fedavg", 0.3, 2, [0.40, 0.76, 0.70, 0.99], [1.0, 2.0, 3.0, 4.0])
    summary = json.loads((longer / "summary.json").read_text())
    (longer / "summary.json").write_text(json.dumps({**summary, "rounds": 4}))
    short = make_run(tmp_path / "short", "fedsam", 0.3, 2, [0.95], [2.0])
    rows = {(r.setting, r.method): r for r in build_rows(runs_at(find_runs([runs_dir, short]), 2), [0.8])}
    assert set(rows) == {("alpha=0.3", "FedAvg"), ("alpha=0.3", "FedSAM"), ("alpha=1", "FedAvg")}
    avg = rows["alpha=0.3", "FedAvg"]  # seeds 0, 1 and the extended seed 2: 0.70, 0.84, 0.76 at round 2
    assert avg.seeds == 3 and avg.rounds == 2
    assert avg.final[0] == pytest.approx(100 * (0.70 + 0.84 + 0.76) / 3)
    assert avg.best[0] == pytest.approx(100 * (0.70 + 0.84 + 0.76) / 3)  # best so far: no later 0.99
    assert avg.targets[0.8] == (2.0, 2.0, 1) and avg.sec_per_round == pytest.approx(1.0)
    sam = rows["alpha=0.3", "FedSAM"]  # the one-round run is not among its seeds
    assert sam.seeds == 2 and sam.final[0] == pytest.approx(83.0) and sam.best[0] == pytest.approx(83.0)
    assert "left out" in capsys.readouterr().err
    with pytest.raises(ReportError, match="no run evaluated round 9"):
        runs_at(find_runs([runs_dir]), 9)
    from fedflat.cli import main

    assert main(["report", str(runs_dir), "--at-round", "1", "--format", "csv"]) == 0
    finals = {r["method"]: r["final_acc_mean"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert float(finals["FedSAM"]) == pytest.approx(60.0)


def test_cli_report_end_to_end(runs_dir, tmp_path, capsys):
    from fedflat.cli import main

    assert main(["report", str(runs_dir), "--target-acc", "0.8", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert len(list(csv.DictReader(io.StringIO(out)))) == 3
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    plots = tmp_path / "figs"
    assert main(["report", str(runs_dir), "--plot", str(plots), "--dpi", "100", "--formats", "png,svg"]) == 0
    assert sorted(p.name for p in plots.iterdir() if p.name.startswith("convergence-alpha1")) == [
        "convergence-alpha1.png", "convergence-alpha1.svg"]
    from fedflat.metrics.plots import png_size

    assert png_size(plots / "convergence-alpha1.png")[0] == 350
    capsys.readouterr()
    assert main(["report", str(runs_dir), "--plot", str(tmp_path / "bad"), "--formats", "png,jpg"]) == 2
    assert "figure formats: jpg; choose among png, pdf, svg" in capsys.readouterr().err
    assert main(["report", str(runs_dir), "--plot", str(tmp_path / "bad"), "--dpi", "0"]) == 2
    assert "--dpi must be a positive number" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_report_flags_repeated_rounds_and_skips_corrupt_folders(tmp_path, capsys):
    """A folder two writers appended to is reported 'corrupt', not 'ok'; an unreadable folder is skipped with
    a warning and the others are still reported."""
    import fedflat
    from conftest import tiny_tree
    from fedflat.config import load_config
    from fedflat.experiments.report import find_runs

    for name in ("good", "doubled", "broken"):
        fedflat.run(load_config(None, ["rounds=3"], base=tiny_tree()), run_dir=tmp_path / name, progress=False)
    lines = (tmp_path / "doubled" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "doubled" / "metrics.jsonl").write_text("".join(lines + lines[1:]))  # rounds 1 2 3 2 3
    (tmp_path / "broken" / "summary.json").write_text("{not json")
    runs = {r.path.name: r for r in find_runs([tmp_path])}
    assert set(runs) == {"good", "doubled"}
    assert runs["doubled"].summary["status"] == "corrupt" and runs["good"].summary["status"] == "completed"
    err = capsys.readouterr().err
    assert "skipped" in err and "broken" in err and "summary.json is not valid JSON" in err


def test_tables_and_figures_name_methods_as_their_papers_do():
    """Issue 59: tables and figures showed config ids (fedavg, fedlesam); each recipe carries the name its paper
    writes, distinct across recipes, and a composition keeps its changed roles."""
    from fedflat.algorithms import RECIPES
    from fedflat.core.registry import display_label

    titles = {name: recipe.display for name, recipe in RECIPES.items()}
    assert [n for n, t in titles.items() if not t] == []
    assert len(set(titles.values())) == len(titles)
    assert (titles["fedavg"], titles["fedlesam"], titles["scaffold"]) == ("FedAvg", "FedLESAM", "SCAFFOLD")
    assert display_label("fedlesam[correction=scaffold]") == "FedLESAM[correction=scaffold]"
    assert display_label("mine") == "mine"  # a plugin's recipe without a display name: its config name


def test_report_output_writes_the_table_and_prints_it(tmp_path, capsys):
    from fedflat.cli import main

    runs_dir = tmp_path / "runs"
    make_run(runs_dir, "fedavg", 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
    assert main(["report", str(runs_dir), "--output", str(tmp_path / "table.md")]) == 0
    out = capsys.readouterr().out
    saved = (tmp_path / "table.md").read_text()
    assert saved.startswith("| setting | method |") and "| FedAvg |" in saved
    assert out.startswith(saved) and f"table: {tmp_path / 'table.md'}" in out


def test_the_table_names_each_methods_radius(tmp_path, capsys):
    """Issue 59: the demo compared FedLESAM at rho 0.01 with FedSAM at 0.05 and the table did not say so. A report
    of runs that perturb has a radius column, read from each run's config.yaml (FedAvg: none)."""
    from fedflat.cli import main

    runs_dir = tmp_path / "runs"
    make_run(runs_dir, "fedavg", 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
    make_run(runs_dir, "fedsam", 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
    scam = make_run(runs_dir, "fedscam", 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
    assert main(["report", str(runs_dir), "--format", "csv"]) == 0
    rows = {r["method"]: r["radius"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    from fedflat.algorithms import RECIPES

    sam = RECIPES["fedsam"].defaults["rho"]
    rho_max = yaml.safe_load((scam / "config.yaml").read_text())["algo"]["perturbation"]["rho_max"]
    assert rows == {"FedAvg": "", "FedSAM": f"rho={sam:g}", "FedSCAM": f"rho_max={rho_max:g}"}
    assert main(["report", str(runs_dir)]) == 0
    assert "| FedSAM | rho=" in capsys.readouterr().out


def test_runs_of_different_sizes_get_their_parameters_and_upload_bytes(tmp_path):
    """Adapters beside a full model: the table says how many parameters each federates and what a client uploads
    a round (the mean of the metrics lines' up_bytes); runs of one size (every table above) have no such columns."""
    runs_dir = tmp_path / "runs"
    for method, seed, params, ups in (("fedavg", 0, 1000, [4000, 4000, 4000]), ("fedavg", 1, 1000, [4000, 4000, 4000]),
                                      ("fedsam", 0, 250, [1000, 1000, 1600])):
        folder = make_run(runs_dir, method, 0.3, seed, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
        summary = json.loads((folder / "summary.json").read_text())
        (folder / "summary.json").write_text(json.dumps({**summary, "parameters": params}))
        lines = [{"round": t + 1, "test_acc": 0.5, "up_bytes": b} for t, b in enumerate(ups)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    rows = {r["method"]: r for r in _markdown_table(report([runs_dir], [], "markdown"))}
    assert rows["FedAvg"]["trainable params"] == "1,000" and rows["FedAvg"]["up (KB/client/round)"] == "4.0"
    assert rows["FedSAM"]["trainable params"] == "250" and rows["FedSAM"]["up (KB/client/round)"] == "1.2"
    by_csv = {r["method"]: r for r in csv.DictReader(io.StringIO(report([runs_dir], [], "csv")))}
    assert by_csv["FedSAM"]["up_bytes_per_client_round"] == "1200" and by_csv["FedAvg"]["trainable_parameters"] == "1000"
    assert report([runs_dir], [], "latex").count(r"\\") >= 3
    one_size = tmp_path / "one"
    make_run(one_size, "fedavg", 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
    assert "trainable params" not in report([one_size], [], "markdown")
    # one model, one method uploading a scalar more (FedSCAM's): the same size, said by comm (x FedAvg), no columns
    for method, up in (("fedavg", 4000), ("fedscam", 4004)):
        folder = make_run(tmp_path / "scalar", method, 0.3, 0, [0.5, 0.6, 0.7], [1.0, 2.0, 3.0])
        summary = json.loads((folder / "summary.json").read_text())
        (folder / "summary.json").write_text(json.dumps({**summary, "parameters": 1000}))
        (folder / "metrics.jsonl").write_text(json.dumps({"round": 1, "test_acc": 0.5, "up_bytes": up}) + "\n")
    assert "trainable params" not in report([tmp_path / "scalar"], [], "markdown")
