"""The batch sweep (benchmarks/batch_sweep.py): a row per batch size from the report's own loop,
latency percentiles, the crossover, and the command line end to end."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.batch_sweep import BatchSweepConfig, crossover, markdown, sweep
from common.config import UserError
from inference import evalsets
from speculators import export

PROMPTS = ["import os\nimport sys\n", "def main():\n    return", "class A:\n", "x = 1\n"]


def test_a_row_per_batch_size_with_latency_percentiles(llama_target, make_drafter):
    drafter = make_drafter(llama_target)
    prompts = evalsets.prompts_of([[text] for text in PROMPTS], None, llama_target, 12)
    cfg = BatchSweepConfig(drafter="unused", batch_sizes=[1, 2, 4], max_new_tokens=12, repeats=2)
    result = sweep(llama_target, drafter, prompts, cfg)
    assert [r["batch_size"] for r in result["rows"]] == [1, 2, 4] and result["k"] == 3
    for r in result["rows"]:
        assert r["outputs_match_baseline"] and len(r["tokens_per_second_repeats"]) == 2
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / r["baseline_tokens_per_second"])
        for key in ("token_latency_ms", "baseline_token_latency_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p95"] <= r[key]["p99"]
    assert "| 4 |" in markdown(result)


def test_crossover_is_where_speculation_stops_paying_for_good():
    def rows(*speedups):
        return [{"batch_size": 2**i, "speedup": s} for i, s in enumerate(speedups)]

    assert crossover(rows(1.5, 1.2, 0.9, 0.7)) == 4
    assert crossover(rows(0.9, 1.1, 0.8)) == 4  # a loss at 1 that turns into a win at 2 is not the crossover
    assert crossover(rows(0.5, 0.4)) == 1
    assert crossover(rows(1.3, 1.1)) is None


@pytest.mark.parametrize("fields, key", [(dict(batch_sizes=[]), "batch_sizes"), (dict(batch_sizes=[0, 2]), "batch_sizes"),
                                         (dict(repeats=0), "repeats")])
def test_bad_config_is_one_line(fields, key):
    with pytest.raises(UserError) as error:
        BatchSweepConfig(drafter="x", **fields)
    assert str(error.value).startswith(key) and "\n" not in str(error.value)


def test_command_line_end_to_end(llama_target, make_drafter, tmp_path):
    drafter_dir = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    out = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.batch_sweep", f"drafter={drafter_dir}",
                             "eval.num_prompts=2", "eval.prompt_lines=2", "max_new_tokens=6", "batch_sizes=[1,2]",
                             "repeats=1", f"out={out}", f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((out / "batch_sweep.json").read_text())
    assert [r["batch_size"] for r in written["rows"]] == [1, 2] and written["config"]["repeats"] == 1
    assert (out / "batch_sweep.png").stat().st_size > 0
    assert f"results: {out / 'batch_sweep.json'}, {out / 'batch_sweep.md'}" in result.stdout
