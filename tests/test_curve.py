"""`python -m benchmarks.curve`: tau against tokens seen, from run directories."""

import json

import pytest

from benchmarks import curve


def runs_of(*paths) -> str:
    """The runs= override: quoted, as pytest's folder names hold characters Hydra's grammar reserves."""
    return "runs=[" + ",".join(f"'{p}'" for p in paths) + "]"


def fake_run(path, steps: int, tau: float, init_from: dict | None = None):
    (path / "export").mkdir(parents=True)
    (path / "acceptance").mkdir()
    facts = {"steps": steps, "tokens_seen": steps * 4096} | ({"init_from": init_from} if init_from else {})
    (path / "export" / "training.json").write_text(json.dumps(facts))
    report = {"acceptance_length": tau, "acceptance_rate_per_position": [tau - 1], "outputs_match_baseline": True,
              "config": {"eval": {"name": "mtbench"}, "max_new_tokens": 64}}
    (path / "acceptance" / "report.json").write_text(json.dumps(report))
    return path


def test_points_sorted_by_tokens_with_a_plot(tmp_path, capsys):
    runs = [fake_run(tmp_path / "late", 200, 1.3), fake_run(tmp_path / "early", 50, 1.1)]
    curve.main([runs_of(*runs), f"out={tmp_path / 'out' / 'curve'}"])
    points = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert [p["tokens_seen"] for p in points] == [50 * 4096, 200 * 4096]
    assert [p["acceptance_length"] for p in points] == [1.1, 1.3]
    assert (tmp_path / "out" / "curve.png").stat().st_size > 0
    assert "tau 1.300" in capsys.readouterr().out


def test_a_continued_run_is_its_own_series(tmp_path):
    earlier = {"path": "models/x", "steps": 200, "tokens_seen": 200 * 4096}
    runs = [fake_run(tmp_path / "first", 200, 1.3), fake_run(tmp_path / "continued", 300, 1.4, earlier)]
    curve.main([runs_of(*runs), f"out={tmp_path / 'curve'}"])
    points = json.loads((tmp_path / "curve.json").read_text())
    assert [p["init_from"] for p in points] == [None, earlier]
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_an_earlier_curve_keeps_its_points_and_takes_new_runs(tmp_path):
    curve.main([runs_of(fake_run(tmp_path / "a", 100, 1.2), fake_run(tmp_path / "b", 200, 1.3)),
                f"out={tmp_path / 'curve'}"])
    (tmp_path / "a" / "export" / "training.json").unlink()  # the run directory gone, its point kept
    fake_run(tmp_path / "c", 300, 1.5)
    (tmp_path / "b" / "acceptance" / "report.json").write_text(json.dumps(
        {"acceptance_length": 1.35, "acceptance_rate_per_position": [0.35], "outputs_match_baseline": True,
         "config": {"eval": {"name": "mtbench"}, "max_new_tokens": 64}}))  # b measured again
    curve.main([runs_of(tmp_path / "curve.json", tmp_path / "b", tmp_path / "c"), f"out={tmp_path / 'curve'}"])
    points = json.loads((tmp_path / "curve.json").read_text())
    assert [(p["steps"], p["acceptance_length"]) for p in points] == [(100, 1.2), (200, 1.35), (300, 1.5)]


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as stopped:
        curve.main([runs_of(tmp_path), f"out={tmp_path / 'c'}"])
    assert "no export/training.json" in str(stopped.value) and "\n" not in str(stopped.value)
    with pytest.raises(SystemExit, match="c.json: no such file"):
        curve.main([runs_of(tmp_path / "c.json"), f"out={tmp_path / 'c'}"])
