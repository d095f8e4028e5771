"""Tau against training tokens: the acceptance reports of runs (or checkpoints) of one recipe, on a plot.

    python -m benchmarks.curve runs=[RUN_DIR,RUN_DIR] out=results/smollm2/data_curve
    python -m benchmarks.curve runs=[results/smollm2/data_curve.json,NEW_RUN_DIR] out=results/smollm2/data_curve

Each RUN_DIR holds what `python train.py` writes: export/training.json (tokens seen) and
acceptance/report.json (the closing report, inference/report.py). A checkpoint becomes such a
folder with `python train.py <its recipe> resume=<checkpoint> trainer.max_steps=<its step>
hydra.run.dir=<folder>`: no step is trained, the export and the report are written. A .json
argument is an earlier curve's points, kept as they are (their run directories may be gone, and
a run measured twice keeps its newest point). Writes <out>.json (the points) and <out>.png.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from common import plots
from common.config import UserError, run_command


@dataclass
class CurveConfig:
    """conf/benchmarks/curve.yaml."""

    runs: list[str] = MISSING  # run directories and earlier curves' .json
    out: str = MISSING  # path without suffix: <out>.json and <out>.png
    title: str = "tau against training tokens"


def point(run_dir: Path) -> dict:
    training, report = run_dir / "export" / "training.json", run_dir / "acceptance" / "report.json"
    for file in (training, report):
        if not file.is_file():
            raise UserError(f"{run_dir}: no {file.relative_to(run_dir)} (a finished `python train.py` run directory?)")
    facts, figures = json.loads(training.read_text()), json.loads(report.read_text())
    return {"run": str(run_dir), "steps": facts["steps"], "tokens_seen": facts["tokens_seen"],
            "init_from": facts.get("init_from"),  # a run that continued another export (its tokens included)
            "acceptance_length": figures["acceptance_length"],
            "acceptance_rate_per_position": figures["acceptance_rate_per_position"],
            "eval": figures["config"]["eval"], "max_new_tokens": figures["config"]["max_new_tokens"],
            "outputs_match_baseline": figures["outputs_match_baseline"]}


def earlier_points(curve_json: Path) -> list[dict]:
    if not curve_json.is_file():
        raise UserError(f"{curve_json}: no such file (an earlier curve's points, as out= wrote them)")
    return json.loads(curve_json.read_text())


def plot(points: list[dict], path: Path, title: str) -> None:
    def series(chosen: list[dict]) -> tuple[list[float], list[float]]:
        return [p["tokens_seen"] / 1e6 for p in chosen], [p["acceptance_length"] for p in chosen]

    continued = [p for p in points if p["init_from"]]
    with plots.figure(path) as ax:
        ax.plot(*series([p for p in points if not p["init_from"]]), marker="o", label="one run")
        if continued:
            ax.plot(*series(continued), marker="s", linestyle="none", label="continued from an export (init_from)")
            ax.legend()
        ax.set(xlabel="training tokens seen (millions)", ylabel="tau (acceptance length)", title=title)
        ax.grid(alpha=0.3)


def curve(cfg: CurveConfig) -> None:
    out = Path(cfg.out)
    by_run = {}
    for source in map(Path, cfg.runs):
        for p in earlier_points(source) if source.suffix == ".json" else [point(source)]:
            by_run[p["run"]] = p
    points = sorted(by_run.values(), key=lambda p: p["tokens_seen"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(points, indent=2))
    plot(points, out.with_suffix(".png"), cfg.title)
    for p in points:
        print(f"{p['steps']:>6} steps {p['tokens_seen']:>12,} tokens  tau {p['acceptance_length']:.3f}")
    print(f"curve: {out.with_suffix('.json')}, {out.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> None:
    """The command; `argv` (tests) stands for the command line's overrides."""
    if argv is not None:
        sys.argv[1:] = argv
    run_command("curve", CurveConfig, curve, config_dir="conf/benchmarks")


if __name__ == "__main__":
    main()
