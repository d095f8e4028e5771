"""`python -m benchmarks.compare`: several exports, same prompts and K, one table and one plot."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import compare
from common.config import UserError
from inference import evalsets, report
from speculators import export

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def exports(llama_target, make_drafter, tmp_path_factory):
    """Two EAGLE-3 exports of different seeds, each with its training record."""
    root = tmp_path_factory.mktemp("compare")
    paths = []
    for seed in (0, 1):
        path = export.save(make_drafter(llama_target, seed=seed), root / f"seed{seed}" / "export",
                           export.Verifier.of(llama_target), training={"family": f"eagle3-seed{seed}", "steps": seed,
                                                                       "tokens_seen": 100 * seed,
                                                                       "wall_time_s": 1800 * seed})
        paths.append(str(path))
    return paths


def test_rows_per_drafter_and_mode_with_measure_s_figures(llama_target, exports, tokenizer, tmp_path):
    cfg = compare.CompareConfig(drafters=exports, modes=["chain", "tree"], max_new_tokens=12,
                                k=3, repeats=2)
    drafters = [(p, export.load(Path(p))[0].eval(), export.training_record(p)) for p in exports]
    prompts = [tokenizer("import os\nimport sys\n")["input_ids"], tokenizer("def main():\n    return")["input_ids"]]
    rows = compare.methods(drafters, cfg)
    assert [r.name for r in rows] == ["target_only", "eagle3-seed0 (chain)", "eagle3-seed0 (tree)",
                                      "eagle3-seed1 (chain)", "eagle3-seed1 (tree)"]
    compare.run(llama_target, rows, prompts, cfg)
    table = compare.summary(rows)
    assert all(r["outputs_match_target_only"] for r in table)
    assert table[0]["speedup"] == 1.0 and table[0]["acceptance_length"] is None
    for r in table[1:]:
        assert len(r["acceptance_rate_per_position"]) == 3 and r["tokens_per_second"] > 0
        assert 0 <= r["acceptance_length_stderr"] < 1 and 0 < r["draft_vocabulary_coverage"] <= 1
        assert max(r["acceptance_rate_per_position"]) <= 1
    # The chain rows are the figures `python -m inference` reports for the same drafter and prompts.
    served = [evalsets.Prompt(ids, 1, tokenizer.decode(ids)) for ids in prompts]
    for (path, drafter, _), row in zip(drafters, (table[1], table[3])):
        alone = report.measure(llama_target, drafter, served, report.InferenceConfig(
            drafter=path, max_new_tokens=12, k=3))
        assert row["acceptance_length"] == pytest.approx(alone["acceptance_length"])
        assert row["acceptance_rate_per_position"] == pytest.approx(alone["acceptance_rate_per_position"])
    assert table[3]["training"]["tokens_seen"] == 100
    # Every drafter row after the first: its tau minus the first's, prompt by prompt.
    assert table[1]["tau_minus_first"] is None and len(table[1]["tau_per_prompt"]) == len(prompts)
    for r in table[2:]:
        differences = [a - b for a, b in zip(r["tau_per_prompt"], table[1]["tau_per_prompt"])]
        assert r["tau_minus_first"]["mean"] == pytest.approx(sum(differences) / len(prompts))
        assert r["tau_minus_first"]["n"] == len(prompts)
    twins = [(path, drafter, {"family": "eagle3"}) for path, drafter, _ in drafters]
    assert [r.name for r in compare.methods(twins, replace(cfg, modes=["chain"]))][1:] == [
        f"eagle3 {exports[0]} (chain)", f"eagle3 {exports[1]} (chain)"]  # one family twice: told apart by path

    result_path = compare.write({"rows": table}, tmp_path)
    markdown = (tmp_path / "compare.md").read_text()
    assert markdown.count("\n") == 2 + len(table) and "eagle3-seed1 (tree)" in markdown
    assert [line.rsplit("|", 2)[1].strip() for line in markdown.splitlines()[2:]] == [
        "-", "0 min", "0 min", "30 min", "30 min"]  # training time: target-only has none
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert json.loads(result_path.read_text())["rows"] == table


def test_tau_standard_error_from_the_acceptance_counts():
    """Accepted counts [0, 1, 1, 3] (k = 3): accepted_at = drafts with >= i accepted = [3, 1, 1];
    the sample standard error of the counts is what the counts alone give."""
    import statistics

    counts = [0, 1, 1, 3]
    accepted_at = [sum(c >= i for c in counts) for i in (1, 2, 3)]
    expected = statistics.stdev(counts) / len(counts) ** 0.5
    assert compare.tau_standard_error(accepted_at, len(counts)) == pytest.approx(expected)


def test_vocabulary_coverage_counts_target_tokens_the_drafter_can_propose():
    from types import SimpleNamespace

    import torch

    drafter = SimpleNamespace(draft_to_target=torch.tensor([1, 4, 7]))
    assert compare.vocabulary_coverage(drafter, [[1, 2, 4], [7, 7, 9, 0, 1]]) == pytest.approx(5 / 8)


@pytest.mark.parametrize("bad, message", [({"drafters": []}, "at least one"),
                                          ({"drafters": ["x"], "modes": ["beam"]}, "drafting.mode"),
                                          ({"drafters": ["x"], "repeats": 0}, "repeats"),
                                          ({"drafters": ["x"], "k": 0}, "k")])
def test_bad_config_is_a_user_error(bad, message):
    with pytest.raises(UserError, match=message):
        compare.CompareConfig(**bad)


def test_config_file_mirrors_the_dataclass():
    from test_config import CONF, composed

    from common.config import to_dataclass

    cfg = to_dataclass(compare.CompareConfig, composed(["drafters=[x]"], CONF / "benchmarks", "compare"))
    assert cfg == compare.CompareConfig(drafters=["x"]) and cfg.k is None
    chosen = composed(["drafters=[x]", "eval=mtbench", "eval.num_prompts=4"], CONF / "benchmarks", "compare")
    assert to_dataclass(compare.CompareConfig, chosen).eval == evalsets.EvalConfig("mtbench", num_prompts=4, turns=2)


def test_cli_end_to_end(llama_dir, exports, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.compare", f"drafters=[{exports[0]},{exports[1]}]",
                             f"target={llama_dir}", "quant=int8", "eval.num_prompts=1", "eval.prompt_lines=2",
                             "max_new_tokens=6", "k=2", "repeats=1", f"out={tmp_path}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "compare.json").read_text())["rows"]
    assert json.loads((tmp_path / "compare.json").read_text())["config"]["quant"]["scheme"] == "int8"  # the target as served
    assert [r["method"] for r in rows] == ["target_only", "eagle3-seed0 (chain)", "eagle3-seed1 (chain)"]
    missing = subprocess.run([sys.executable, "-m", "benchmarks.compare", f"drafters=[{tmp_path / 'nope'}]"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("error:")
