"""The quantization report (benchmarks/quant_report.py) on the tiny random Llama of conftest.py.

Two random EAGLE-3 drafters stand in for one trained against the full-precision target and one
trained against the int4 target. The report runs once (schemes none, int8, int4; none is the
sanity row: a second full-precision copy must show no drift at all) and the tests check its tables:
every row and column, tau equal to inference.report.measure's for the same (target, drafter) pair,
the cross table serving the drafters it was given, KL against a direct computation, and the
one-line errors of bad input. One run goes through the command line end to end.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.quant_report import FULL, STEPS, QuantReportConfig, greedy_agreement, load, markdown, measure, write
from common.config import PROJECT_ROOT, UserError, to_dataclass
from inference import evalsets, report
from speculators import export
from speculators.quant import QuantConfig

PROMPTS = ["import os\nimport sys\n", "def main():\n    return", "class A:\n", "x = 1\n"]
NEW_TOKENS, K = 16, 3
COLUMNS = {"target", "drafter", "weight_bytes", "decode_tokens_per_s", "tokens_per_s_repeats", "speedup_vs_baseline",
           "acceptance_length", "greedy_agreement", "mean_equal_prefix", "mean_kl_fp_to_served",
           "same_output_as_target_alone"}


@pytest.fixture(scope="module")
def exports(llama_target, make_drafter, tmp_path_factory) -> dict[str, Path]:
    """Export folders of two different random drafters: 'fp' (nominally trained against the
    full-precision target) and 'int4' (against the int4 target)."""
    folder = tmp_path_factory.mktemp("quant_report_exports")
    verifier = export.Verifier.of(llama_target)
    return {key: export.save(make_drafter(llama_target, seed=seed), folder / key, verifier)
            for key, seed in ((FULL, 1), ("int4", 2))}


@pytest.fixture(scope="module")
def cfg(exports, llama_dir) -> QuantReportConfig:
    return QuantReportConfig(drafter=str(exports[FULL]), quantized_drafters={"int4": str(exports["int4"])},
                             target=str(llama_dir), schemes=["none", "int8", "int4"], self_drafts={"none": "int8"},
                             self_draft_tokens=K, max_new_tokens=NEW_TOKENS, k=K, repeats=2)


@pytest.fixture(scope="module")
def loaded(cfg):
    return load(cfg)


@pytest.fixture(scope="module")
def result(cfg, loaded):
    targets, drafters = loaded
    return measure(targets, drafters, served(targets[FULL]), cfg)


def served(target) -> list[evalsets.Prompt]:
    """PROMPTS as raw text, as eval=file serves them on a target tokenizer without a chat template."""
    return evalsets.prompts_of([[text] for text in PROMPTS], None, target, NEW_TOKENS)


def tau_of_measure(target, drafter) -> float:
    """tau of the same pair from inference.report.measure, with the report's decoding settings."""
    settings = report.InferenceConfig(drafter="unused", max_new_tokens=NEW_TOKENS, k=K)
    return report.measure(target, drafter, served(target), settings)["acceptance_length"]


def test_report_has_every_row_and_column(result, tmp_path):
    for scheme in ("none", "int8", "int4"):
        rows = result["four_way"][scheme]["rows"]
        assert list(rows) == list(STEPS)
        for step, row in rows.items():
            assert set(row) == COLUMNS, (scheme, step)
            assert row["decode_tokens_per_s"] > 0 and len(row["tokens_per_s_repeats"]) == 2
            assert (row["acceptance_length"] is None) == (row["drafter"] is None)
        assert rows["baseline"]["speedup_vs_baseline"] == 1.0
        assert (rows["baseline"]["target"], rows["speculation_only"]["drafter"]) == (FULL, FULL)
        assert rows["quantization_only"]["target"] == rows["both"]["target"] == scheme
    # "both" serves the drafter trained against the quantized target when there is one, and says which.
    assert result["four_way"]["int4"]["rows"]["both"]["drafter"] == result["four_way"]["int4"]["both_drafter"] == "int4"
    assert result["four_way"]["int8"]["rows"]["both"]["drafter"] == FULL
    # Weight memory: int4 < int8 < full precision (lm_head and embeddings kept in fp32 in all three).
    weights = {s: result["four_way"][s]["rows"]["quantization_only"]["weight_bytes"] for s in ("none", "int8", "int4")}
    assert weights["int4"] < weights["int8"] < weights["none"]
    assert 0 < result["four_way"]["int4"]["quant_dequant_rel_error"] < 0.2
    assert result["four_way"]["none"]["quant_dequant_rel_error"] is None

    path = write(result, tmp_path)
    assert json.loads(path.read_text())["four_way"]["int4"]["rows"]["both"]["drafter"] == "int4"
    tables = (tmp_path / "quant_report.md").read_text()
    assert tables == markdown(result)
    for line in ("| quantization only | int4 | - |", "| both | int4 | trained on int4 |",
                 "| both | int8 | trained on full precision |", "| speculation only | full precision | trained on "
                 "full precision |"):
        assert line in tables
    header = "| | target | drafter | target weights (MiB) | tokens/s | speed-up | tau | greedy agreement "
    assert tables.count(header) == 3  # one four-way table per scheme
    rows = [line for line in tables.splitlines() if line.split("|")[1:2] and line.split("|")[1].strip() in STEPS.values()]
    assert len(rows) == 3 * 4 and all(row.count("|") == 12 for row in rows)  # 11 columns each


def test_drift_of_an_unquantized_copy_is_exactly_zero(result):
    none = result["four_way"]["none"]["rows"]["quantization_only"]
    assert none["greedy_agreement"] == 1.0 and none["mean_kl_fp_to_served"] == 0.0
    assert none["mean_equal_prefix"] == NEW_TOKENS
    for row in result["four_way"]["int4"]["rows"].values():  # rows on the full-precision target do not drift
        if row["target"] == FULL:
            assert row["greedy_agreement"] == 1.0 and row["mean_kl_fp_to_served"] == 0.0
    int4 = result["four_way"]["int4"]["rows"]["quantization_only"]
    assert int4["mean_kl_fp_to_served"] > 0 and int4["greedy_agreement"] < 1  # a tiny random target drifts at int4


def test_kl_matches_a_direct_computation(result, loaded):
    targets, _ = loaded
    reference = result["outputs"]["target=fp drafter=-"]
    kls = []
    for text, continuation in zip(PROMPTS, reference):
        ids = targets[FULL].tokenizer(text)["input_ids"]
        sequence = torch.tensor([ids + continuation])
        logits = {key: targets[key].model(sequence).logits[0, len(ids) - 1: -1] for key in (FULL, "int4")}
        # F.kl_div(input=log q, target=log p) = sum p (log p - log q) per position
        kls.append(F.kl_div(logits["int4"].log_softmax(-1), logits[FULL].log_softmax(-1), log_target=True,
                            reduction="none").sum(-1))
    expected = float(torch.cat(kls).mean())
    assert result["four_way"]["int4"]["rows"]["quantization_only"]["mean_kl_fp_to_served"] == pytest.approx(expected,
                                                                                                             rel=1e-5)


def test_greedy_agreement_counts_up_to_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6]]
    assert greedy_agreement([[1, 2, 9, 4], [5, 6]], reference) == (4 / 6, 2.0)  # the 4 after the 9 does not count
    assert greedy_agreement(reference, reference) == (1.0, 3.0)


def test_tau_equals_measure_for_the_same_pair(result, loaded):
    targets, drafters = loaded
    rows = result["four_way"]
    assert rows["int4"]["rows"]["speculation_only"]["acceptance_length"] == tau_of_measure(targets[FULL], drafters[FULL])
    for scheme in ("int8", "int4"):
        both = rows[scheme]["rows"]["both"]
        assert both["acceptance_length"] == tau_of_measure(targets[scheme], drafters[both["drafter"]])
        assert both["same_output_as_target_alone"] == 1  # greedy speculation is lossless on the quantized target


def test_cross_table_serves_the_drafters_it_was_given(result, loaded):
    targets, drafters = loaded
    cross = result["cross"]["int4"]
    fp_on_int4, own_on_int4 = (tau_of_measure(targets["int4"], drafters[key]) for key in (FULL, "int4"))
    assert fp_on_int4 != own_on_int4  # the two random drafters are told apart on these prompts
    assert cross["fp_drafter_on_quantized_target"]["acceptance_length"] == fp_on_int4
    assert cross["quantized_drafter_on_quantized_target"]["acceptance_length"] == own_on_int4
    assert cross["fp_drafter_on_fp_target"]["acceptance_length"] == tau_of_measure(targets[FULL], drafters[FULL])
    assert result["cross"]["int8"]["quantized_drafter_on_quantized_target"] is None  # none given for int8
    assert result["drafters"]["int4"] == {"path": str(result["config"]["quantized_drafters"]["int4"]),
                                          "trained_against": "int4", "k": K}
    int8_line = next(line for line in markdown(result).splitlines() if line.startswith("| int8 |"))
    assert int8_line.endswith("| - | - |")


def test_self_speculation_rows_sit_beside_the_target_alone_and_the_drafter(result, tmp_path):
    (entry,) = result["self_speculation"]
    assert (entry["target"], entry["copy"]) == (FULL, "int8")
    assert [entry[key]["drafter"] for key in ("alone", "drafter", "self")] == [None, FULL, "self:int8"]
    own = entry["self"]
    assert own["same_output_as_target_alone"] == 1  # greedy self-speculation is lossless
    assert own["acceptance_length"] > entry["drafter"]["acceptance_length"]  # an int8 copy agrees more than a random head
    assert result["drafters"]["self:int8"]["trained_against"].startswith("not trained")
    tables = markdown(result)
    assert "| full precision | its int8 copy |" in tables
    write(result, tmp_path)
    assert (tmp_path / "quant_report.png").stat().st_size > 0


def test_the_tables_say_how_many_tokens_each_drafter_drafts(result):
    assert markdown(result).startswith(f"{len(PROMPTS)} prompts, {NEW_TOKENS} new tokens each, greedy, {K}-token "
                                       f"chain drafts;")
    drafters = {**result["drafters"], "int4": {**result["drafters"]["int4"], "k": K - 1}}
    assert f"greedy, K-token (full precision drafter {K}, int4 drafter {K - 1}, int8 copy {K}) chain drafts;" in markdown(
        {**result, "drafters": drafters})


@pytest.mark.parametrize("fields, key", [
    (dict(schemes=["int3"]), "schemes"),
    (dict(schemes=[]), "schemes"),
    (dict(schemes=["int4", "int4"]), "schemes"),
    (dict(schemes=["int8"], quantized_drafters={"int4": "x"}), "quantized_drafters.int4"),
    (dict(schemes=["none", "int4"], quantized_drafters={"none": "x"}), "quantized_drafters.none"),
    (dict(group_size=3), "group_size"),
    (dict(max_new_tokens=1), "max_new_tokens"),
    (dict(k=0), "k"),
    (dict(schemes=["int8", "int4"], self_drafts={"int4": "int8"}), "self-drafting scheme='int8'"),  # not lower
    (dict(schemes=["int8"], self_drafts={"int8": "int8"}), "self-drafting scheme='int8'"),
    (dict(schemes=["int8"], self_drafts={"none": "int4"}), "self_drafts.none"),  # not a reported scheme
    (dict(schemes=["int8"], self_draft_tokens=0), "self_draft_tokens"),
])
def test_bad_config_is_a_one_line_error(fields, key):
    with pytest.raises(UserError) as error:
        QuantReportConfig(drafter="x", **fields)
    assert key in str(error.value) and "\n" not in str(error.value)


def test_bad_exports_are_one_line_errors(cfg, exports, tmp_path):
    missing = str(tmp_path / "missing")
    for fields, key in ((dict(drafter=missing), "drafter"), (dict(quantized_drafters={"int4": missing}),
                                                             "quantized_drafters.int4")):
        with pytest.raises(UserError, match=f"^{key}=.*no such export folder$"):
            load(replace(cfg, **fields))
    # An export whose training record names another quantization than the one it is served with.
    drafter, _ = export.load(exports["int4"])
    int8_trained = export.save(drafter, tmp_path / "int8_trained", export.Verifier("v", ["A"]),
                               training={"quant": asdict(QuantConfig("int8"))})
    with pytest.raises(UserError) as error:
        load(replace(cfg, quantized_drafters={"int4": str(int8_trained)}))
    message = str(error.value)
    assert "quantized_drafters.int4" in message and "int8" in message and "\n" not in message


def test_config_file_mirrors_the_dataclass():
    from test_config import CONF, composed

    cfg = to_dataclass(QuantReportConfig, composed(["drafter=some/export"], CONF / "benchmarks", "quant_report"))
    assert cfg == QuantReportConfig(drafter="some/export")
    assert cfg.target == str(PROJECT_ROOT / "models" / "pycode") and cfg.schemes == ["int8", "int4"]
    given = composed(["drafter=d", "quantized_drafters={int4:runs/q/export}", "schemes=[int4]"], CONF / "benchmarks",
                     "quant_report")
    assert to_dataclass(QuantReportConfig, given).quantized_drafters == {"int4": "runs/q/export"}
    with pytest.raises(UserError, match="schemes"):
        to_dataclass(QuantReportConfig, composed(["drafter=d", "schemes=[int3]"], CONF / "benchmarks", "quant_report"))


def test_command_line_end_to_end(exports, llama_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(text) + "\n" for text in PROMPTS[:2]))
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.quant_report", f"drafter={exports[FULL]}",
         f"quantized_drafters={{int4:{exports['int4']}}}", f"target={llama_dir}", "eval=file", f"eval.path={prompts}",
         "max_new_tokens=8", "k=2", "repeats=1", f"out={out}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((out / "quant_report.json").read_text())
    assert list(written["four_way"]) == ["int8", "int4"] and written["prompts"] == PROMPTS[:2]
    assert written["config"]["target"] == str(llama_dir) and written["machine"]["torch"] == torch.__version__
    assert (out / "quant_report.md").read_text() in result.stdout
    assert f"quantization report: {out / 'quant_report.json'}" in result.stdout


def test_quant_bench_measures_the_ways_it_is_given(llama_dir):
    from benchmarks import quant_bench

    result = quant_bench.run(str(llama_dir), num_prompts=1, new_tokens=4, repeats=1, all_weights=False,
                             decode_only=True, chosen=["w8a8", "int8/packed"])
    rows = result["schemes"]
    assert list(rows) == ["none", "w8a8", "int8/packed"]  # the baseline always stays
    assert rows["none"]["speedup_vs_none"] == 1 and rows["none"]["quant_dequant_rel_error"] is None
    assert 0 < rows["w8a8"]["quant_dequant_rel_error"] < 0.01
    assert rows["int8/packed"]["quant_dequant_rel_error"] is None  # its scheme's row was not measured
    assert rows["w8a8"]["weight_bytes"] < rows["none"]["weight_bytes"]
    with pytest.raises(UserError, match=r"--ways='int3' is not valid"):
        quant_bench.run(str(llama_dir), 1, 4, 1, False, chosen=["int3"])
