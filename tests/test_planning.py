"""Cost-aware verification (inference/planning.py), calibration (inference/calibration.py) and
`python -m benchmarks.planning`: the plan's choice from costs and estimates, step-cost tables from another machine
or target, sts.json files, reliability figures, and greedy outputs identical to target-only decoding for every
family the plan serves."""

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from common.config import UserError
from inference import calibration
from inference.drafting import DraftingConfig, lookup_drafting
from inference.engine import generate
from inference.planning import (
    Calibration,
    Planner,
    StepCosts,
    logit,
    machine,
    make_planner,
    read_calibration,
    target_key,
)
from inference.sessions import open_session
from speculators import export

REPO = Path(__file__).resolve().parent.parent


def planner(verify_ms, per_pass=True, draft_ms=0.0, temperatures=None) -> Planner:
    fitted = Calibration(temperatures, [0.0] * len(temperatures)) if temperatures else None
    p = Planner(StepCosts(list(verify_ms), 16, "t", machine()), per_pass, fitted)
    if draft_ms:
        p.record_draft(draft_ms / 1000, 1)
    return p


def test_the_plan_takes_the_global_best_over_a_staircase_of_costs():
    """Flat costs up to 4 tokens then a riser: the best is the right edge of the shelf (3 drafts), not the
    first drop and not everything."""
    p = planner([10, 10, 10, 10, 30, 30, 30, 30, 30])
    assert p.best_length([0.9] * 8) == 3
    assert planner([10] * 9).best_length([0.9] * 8) == 8  # free verification: verify all
    assert planner([10, 20, 30, 40]).best_length([0.2] * 3) == 0  # every draft costs a step, few survive


def test_a_chain_keeps_drafting_while_some_longer_prefix_pays():
    p = planner([10, 11, 12, 13, 14, 15], per_pass=False, draft_ms=2.0)
    assert p.keep_going([0.95], 5) and p.keep_going([0.95, 0.9], 5)
    assert not p.keep_going([0.95, 0.05], 5)  # draft 2 is unlikely to survive: verify one
    assert not p.keep_going([0.95, 0.3], 5) and p.keep_going([0.95, 0.3], 5, spent=2)  # once drafted, verifying it pays
    p.trims = False
    assert p.keep_going([0.95, 0.05], 5) and p.best_length([0.1] * 4) == 4  # a calibration pass verifies all


def test_estimates_are_scaled_per_position():
    p = planner([10, 11], temperatures=[2.0, 0.5])
    assert p.calibrated(1, 2.0) == pytest.approx(1 / (1 + math.exp(-1.0)))
    assert p.calibrated(2, 1.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert p.calibrated(7, 1.0) == pytest.approx(1 / (1 + math.exp(-2.0)))  # past the file: its last


def test_a_cost_table_from_another_machine_or_target_is_said_and_measured_again(llama_target, tmp_path, capsys):
    table = tmp_path / "costs.json"
    StepCosts([1.0, 2.0], 8, target_key(llama_target), "another machine").save(table)
    costs = StepCosts.cached(lambda n: open_session(llama_target, n),
                             target_key(llama_target), 3, 8, str(table))
    out = capsys.readouterr().out
    assert "was measured for machine 'another machine'" in out and "measuring again" in out
    assert costs.machine == machine() and len(costs.verify_ms) == 3 and all(ms > 0 for ms in costs.verify_ms)
    assert json.loads(table.read_text())["machine"] == machine()  # the new table replaced it
    StepCosts([1.0, 2.0, 3.0], 8, "another target", machine()).save(table)
    StepCosts.cached(lambda n: open_session(llama_target, n),
                     target_key(llama_target), 3, 8, str(table))
    assert "was measured for target 'another target'" in capsys.readouterr().out
    costs.write_sps(tmp_path / "sps.json", 1.5)
    sps = json.loads((tmp_path / "sps.json").read_text())
    assert sps["token_counts"] == [1, 2, 3] and len(sps["step_time_ms"]) == 3 and sps["fixed_overhead_ms"] == 1.5


def test_calibration_files_are_checked(llama_target, tmp_path):
    good = tmp_path / "sts.json"
    calibration.write_sts(Calibration([0.8, 1.2], [0.0, -0.5]), good, llama_target)
    assert read_calibration(good, llama_target.fingerprint()) == Calibration([0.8, 1.2], [0.0, -0.5])
    assert json.loads(good.read_text())["sts_temperatures"] == [0.8, 1.2]  # TensorRT-LLM's key
    (tmp_path / "theirs.json").write_text('{"sts_temperatures": [1.0, 1.1]}')  # another tool's: no biases
    assert read_calibration(tmp_path / "theirs.json", "x").biases == [0.0, 0.0]
    with pytest.raises(UserError, match="was fitted for another target") as error:
        read_calibration(good, "0123456789abcdef")
    assert "\n" not in str(error.value)
    (tmp_path / "bad.json").write_text('{"sts_temperatures": [1.0, -2]}')
    with pytest.raises(UserError, match="positive numbers"):
        read_calibration(tmp_path / "bad.json", "x")
    (tmp_path / "short.json").write_text('{"sts_temperatures": [1.0, 2.0], "sts_biases": [0.5]}')
    with pytest.raises(UserError, match="sts_biases must be 2 finite numbers"):
        read_calibration(tmp_path / "short.json", "x")
    (tmp_path / "worse.json").write_text("{")
    with pytest.raises(UserError, match="not a calibration file"):
        read_calibration(tmp_path / "worse.json", "x")


def test_temperature_scaling_fixes_an_overconfident_estimate():
    """Estimates sigmoid(2z) for events of probability sigmoid(z): the fitted temperature is about 2, and the
    ECE and Brier score fall; AUROC is unchanged (scaling keeps the order)."""
    rng = random.Random(0)
    pairs = []
    for _ in range(4000):
        z = rng.gauss(0.5, 1.5)
        pairs.append((1, 1 / (1 + math.exp(-2 * z)), rng.random() < 1 / (1 + math.exp(-z))))
    fitted = calibration.fit(pairs, 2)
    assert fitted.temperatures[0] == pytest.approx(2.0, rel=0.15) and fitted.temperatures[1] == fitted.temperatures[0]
    assert abs(fitted.biases[0]) < 0.1  # the estimates were too sharp, not too high on average
    before, after = calibration.summary(pairs)["all"], calibration.summary(calibration.apply(pairs, fitted))["all"]
    assert after["ece"] < 0.5 * before["ece"] and after["brier"] < before["brier"]
    assert after["auroc"] == pytest.approx(before["auroc"]) and 0.6 < after["auroc"] < 1


def test_a_position_seen_too_little_takes_the_shared_temperature():
    """Position 2 never accepted and position 3 never served in the calibration prompts: neither is scaled to a
    grid end (which would keep the planner from ever verifying it), both take position 1's fit over all drafts;
    with too few drafts of either outcome anywhere, nothing is scaled."""
    rng = random.Random(1)
    first = [(1, 1 / (1 + math.exp(-2 * z)), rng.random() < 1 / (1 + math.exp(-z))) for z in
             (rng.gauss(0.0, 1.5) for _ in range(2000))]
    never = [(2, 0.2, False)] * 200
    fitted = calibration.fit(first + never, 3)
    temperatures = fitted.temperatures
    assert temperatures[0] == pytest.approx(calibration.fit(first, 1).temperatures[0], rel=0.2)
    assert min(calibration.GRID) < temperatures[1] == temperatures[2] < max(calibration.GRID)
    assert calibration.fit(never + [(1, 0.9, True)] * 5, 2).temperatures == [1.0, 1.0]
    # Its bias brings position 2 (never accepted in 200) low, not to 0; position 3 takes position 2's.
    assert 0.001 < fitted.estimate(2, logit(0.2)) < 0.02 and fitted.biases[2] == fitted.biases[1]


def test_a_bias_lowers_estimates_too_high_on_both_sides_of_one_half():
    """Drafts accepted with chance sigmoid(z - 1.5) whose estimate is sigmoid(z), z on both sides of 0: a
    temperature pivots at 1/2 and cannot lower them all; the bias does, and the ECE falls by four fifths."""
    rng = random.Random(2)
    pairs = [(1, 1 / (1 + math.exp(-z)), rng.random() < 1 / (1 + math.exp(1.5 - z)))
             for z in (rng.gauss(0.0, 2.0) for _ in range(4000))]
    fitted = calibration.fit(pairs, 1)
    assert fitted.biases[0] < -0.8  # fitted after the temperature (TensorRT-LLM's, kept as it fits alone)
    temperature_only = Calibration(fitted.temperatures, [0.0])
    before = calibration.summary(calibration.apply(pairs, temperature_only))["all"]["ece"]
    after = calibration.summary(calibration.apply(pairs, fitted))["all"]["ece"]
    assert after < 0.06 < 0.15 < before


@pytest.mark.parametrize("kind", ["eagle3", "dspark", "medusa", "lookup"])
def test_planned_greedy_outputs_are_the_targets_own(llama_target, make_drafter, text_batch, tmp_path, kind):
    from test_dspark import make_dspark
    from test_medusa import make_medusa

    drafter = {"dspark": lambda: make_dspark(llama_target, text_batch),
               "medusa": lambda: make_medusa(llama_target)}.get(kind, lambda: make_drafter(llama_target))()
    drafting = DraftingConfig(plan=True, cost_table=str(tmp_path / "costs.json"),
                              prompt_lookup_max=3 if kind == "lookup" else 0)
    for row in range(2):
        prompt = text_batch[row, :16].tolist()
        plain = generate(llama_target, None, prompt, 32)
        spec = generate(llama_target, drafter.eval(), prompt, 32, k=3, drafting=drafting)
        assert spec.tokens == plain.tokens
        assert spec.stats.estimates and spec.stats.num_draft_tokens <= 3 * spec.stats.num_drafts
    assert make_planner(llama_target, drafter, 3, drafting).draft_ms  # the drafter's cost, measured as it served


def test_lookup_in_front_shares_the_drafters_planner_with_costs_for_its_longer_chains(llama_target, make_drafter,
                                                                                     tmp_path):
    drafter = make_drafter(llama_target)
    table = str(tmp_path / "costs.json")
    planner = make_planner(llama_target, drafter, 2, DraftingConfig(plan=True, cost_table=table))
    planner.calibration = Calibration([2.0, 2.0], [0.0, 0.0])  # as a calibration pass leaves it
    assert len(planner.costs.verify_ms) == 3
    behind_lookup = make_planner(llama_target, drafter, 2, replace(lookup_drafting(5, plan=True), cost_table=table))
    assert behind_lookup is planner and planner.calibration.temperatures == [2.0, 2.0]
    assert len(planner.costs.verify_ms) == 6  # root + a lookup chain of 5, measured rather than extrapolated


def test_plans_are_refused_where_they_do_not_apply(llama_target, make_drafter, text_batch):
    with pytest.raises(UserError, match="drafting.plan"):
        DraftingConfig(plan=True, mode="tree")
    with pytest.raises(UserError, match="drafting.chain_min_prob"):
        DraftingConfig(plan=True, chain_min_prob=0.3)
    with pytest.raises(UserError, match="use batch_size=1"):
        DraftingConfig(plan=True).check_batch(2)


def test_the_planning_benchmark_writes_its_tables(llama_target, make_drafter, tmp_path):
    path = export.save(make_drafter(llama_target), tmp_path / "a" / "export", export.Verifier.of(llama_target))
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECULATORS_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "benchmarks.planning", f"drafters=[{path}]", "eval.num_prompts=3",
                             "calibration_prompts=1", "max_new_tokens=12", "repeats=1", "ks=[1,3]",
                             "beside_export=true", "lookup_tokens=5", f"out={out}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((out / "planning.json").read_text())
    assert [r["method"] for r in figures["rows"]] == ["target_only", "a K=1", "a K=3", "a plan", "a K=1 + lookup",
                                                      "a plan + lookup"]
    assert all(r["outputs_match_target_only"] for r in figures["rows"])
    drafter = figures["drafters"]["a"]
    assert drafter["best_fixed_k"] in ("a K=1", "a K=3")
    assert drafter["reliability"]["after"]["all"]["drafts"] > 0 and len(drafter["step_costs_ms"]) >= 6  # lookup's 5
    assert json.loads((path / "sts.json").read_text())["sts_temperatures"]
    assert json.loads((path / "sps.json").read_text())["token_counts"][0] == 1
    assert export.load(path)[0].calibration_file == path / "sts.json"  # served with it from now on
    assert "ECE before" in (out / "planning.md").read_text()
