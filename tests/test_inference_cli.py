"""`python -m inference`: report.json, acceptance.png and the table, and the same report in W&B (offline)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from speculators import export

REPO = Path(__file__).resolve().parent.parent


def test_report_files_and_an_offline_wandb_run(llama_dir, llama_target, make_drafter, tmp_path):
    drafter_dir = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    out = tmp_path / "report"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    env.pop("WANDB_MODE", None)
    result = subprocess.run([sys.executable, "-m", "inference", f"drafter={drafter_dir}", "eval.num_prompts=2",
                             "eval.prompt_lines=2", "max_new_tokens=8", "k=2", f"out={out}",
                             "logger.kind=wandb", "logger.mode=offline", "logger.project=test"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == str(llama_dir)  # the verifier the export names
    assert len(report["acceptance_rate_per_position"]) == 2 and report["outputs_match_baseline"] is True
    assert (out / "acceptance.png").stat().st_size > 0
    assert f"report: {out / 'report.json'}" in result.stdout
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert json.loads((runs[0] / "files" / "report.json").read_text()) == report


def test_quant_serves_the_training_recipes_quantized_targets():
    from hydra import compose, initialize_config_dir

    from common.config import to_dataclass
    from inference.report import InferenceConfig  # its module registers conf/quant/ as the quant group
    from speculators.quant import QuantConfig

    with initialize_config_dir(str(REPO / "conf" / "inference"), version_base="1.3"):
        default = to_dataclass(InferenceConfig, compose("config", ["drafter=x"]))
        int4 = to_dataclass(InferenceConfig, compose("config", ["drafter=x", "quant=int4", "quant.group_size=64"]))
    assert default.quant == QuantConfig()
    assert int4.quant == QuantConfig(scheme="int4", group_size=64)


def test_the_export_serves_the_k_its_closing_report_measured(llama_dir, tmp_path, monkeypatch):
    """The export records the K its closing report measured (serve_eval.ks=[3]: 3), and every inference command
    drafts that many tokens unless told otherwise."""
    from test_reliability import copy_small_stdlib, replace_key, run_in_process, tiny_inference, tiny_training

    from benchmarks import bench, compare, parity, quant_report
    from inference import evalsets, report

    run_dir, stdlib = tmp_path / "run", tmp_path / "stdlib"
    stdlib.mkdir()
    args = replace_key(tiny_training(llama_dir, copy_small_stdlib(stdlib), run_dir), "drafter.depth=5")
    args.append("serve_eval.ks=[3]")
    code, stderr = run_in_process("train", args, monkeypatch)
    assert code in (0, None), stderr
    exported = run_dir / "export"
    methods = json.loads((exported / "config.json").read_text())["speculators_config"]["proposal_methods"]
    assert [m["speculative_tokens"] for m in methods] == [3]
    assert export.load(exported)[0].depth == 5

    out = tmp_path / "served"
    args = [a for a in tiny_inference(exported, out) if not a.startswith("k=")]
    code, stderr = run_in_process("inference", args, monkeypatch)
    assert code in (0, None), stderr
    served = json.loads((out / "report.json").read_text())
    assert len(served["acceptance_rate_per_position"]) == 3 and served["config"]["k"] == 3

    # The other commands, on one short prompt: the drafter's own K unless k says otherwise.
    drafter, target = report.load_pair(str(exported))
    prompts = evalsets.prompts_of([["def add(a, b):\n"]], None, target, 4)
    ids = [p.ids for p in prompts]
    rows = bench.run(target, drafter, None, ids, bench.BenchConfig(drafter=str(exported), max_new_tokens=4,
                                                                  modes=["chain"], repeats=1, chain_lengths=[1]))
    assert rows["speculative_chain"]["k"] == 3
    assert rows["speculative_chain_k1"]["k"] == 1
    assert rows["speculative_chain_k1"]["outputs_match_target_only"] is True
    rows = compare.methods([(str(exported), drafter, None)], compare.CompareConfig(drafters=[str(exported)]))
    compare.run(target, rows, ids, compare.CompareConfig(drafters=[str(exported)], max_new_tokens=4, repeats=1))
    assert [len(r["acceptance_rate_per_position"]) for r in compare.summary(rows)] == [0, 3]
    assert compare.methods([(str(exported), drafter, None)], compare.CompareConfig(
        drafters=[str(exported)], k=2))[1].k == 2
    cfg = quant_report.QuantReportConfig(drafter=str(exported), target=str(llama_dir), schemes=["none"],
                                         max_new_tokens=4, repeats=1)
    result = quant_report.measure(*quant_report.load(cfg), prompts, cfg)
    assert result["drafters"]["fp"]["k"] == 3 and "3-token chain drafts" in quant_report.markdown(
        result)
    # Training's own report served it with K=3, and parity serves the export as that report did.
    assert len(json.loads((run_dir / "acceptance" / "report.json").read_text())["acceptance_rate_per_position"]) == 3
    parity.check(str(exported))


def test_a_drafter_trained_for_another_target_is_refused(llama_dir, llama_target, make_drafter, tokenizer, tmp_path):
    """Same shapes, other weights: refused with one line naming both targets; a quantized serve of its own
    target is the same target."""
    import pytest
    from conftest import make_model

    from common.config import UserError
    from inference import report
    from speculators.quant import QuantConfig

    other = tmp_path / "other-target"
    make_model("llama", tokenizer, seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    record = {"target": str(llama_dir), "target_fingerprint": llama_target.fingerprint()}
    exported = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target),
                           training=record)
    with pytest.raises(UserError) as refused:
        report.load_pair(str(exported), str(other))
    assert str(llama_dir) in str(refused.value) and str(other) in str(refused.value)
    assert "\n" not in str(refused.value)
    _, served = report.load_pair(str(exported), quant=QuantConfig(scheme="int8"))
    assert served.fingerprint() == llama_target.fingerprint()


def test_drafters_compared_on_one_target_get_the_layers_they_read(llama_dir, llama_target, make_drafter, tmp_path):
    """A comparison serves every drafter with one target, loaded for the layers they read: an EAGLE-1 (none: the
    last state) first beside an EAGLE-3 (LAYER_IDS) gets a target serving LAYER_IDS; two drafters reading
    different layers are refused in one line, and so is a drafter served by a target loaded for other layers."""
    import pytest
    import torch
    from conftest import LAYER_IDS

    from common.config import UserError
    from inference import report
    from inference.engine import check_pair
    from speculators.eagle import EagleConfig, EagleDrafter

    counts = torch.ones(llama_target.vocab_size)
    verifier = export.Verifier.of(llama_target)
    eagle1 = export.save(EagleDrafter.from_target(EagleConfig(depth=2), llama_target, counts), tmp_path / "eagle1",
                         verifier)
    eagle3 = export.save(make_drafter(llama_target), tmp_path / "eagle3", verifier)
    other_layers = make_drafter(llama_target)
    other_layers.layer_ids = [2, 1, 0]  # the same shapes, other layers
    moved = export.save(other_layers, tmp_path / "other-layers", verifier)

    drafters, target = report.load_drafters([str(eagle1), str(eagle3)])
    assert target.layer_ids == LAYER_IDS and [type(d).__name__ for d in drafters] == ["EagleDrafter", "Eagle3Drafter"]
    with pytest.raises(UserError, match="different target layers") as refused:
        report.load_drafters([str(eagle3), str(moved)])
    assert "[2, 1, 0]" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UserError, match=r"reads target layers \[2, 1, 0\]; the target was loaded to serve \[0, 1, 2\]"):
        check_pair(target, export.load(moved)[0])


def never_loaded(*args, **kwargs):
    raise AssertionError("the target loaded before the drafter was refused")


def test_a_drafter_served_with_a_target_of_other_sizes_is_refused_before_it_loads(
        llama_dir, llama_target, make_drafter, tokenizer, tmp_path, monkeypatch):
    """The SmolLM2 drafter with another target: one line naming every size that differs and the target it was
    trained for, read from the other target's config alone (not its loading's complaint about layer ids)."""
    from test_reliability import one_line_error, run_in_process, tiny_inference
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculators.target import FrozenTarget

    other = tmp_path / "other-target"
    sizes = LlamaConfig(vocab_size=len(tokenizer) + 64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(sizes).save_pretrained(other)
    tokenizer.save_pretrained(other)
    record = {"target": str(llama_dir), "target_fingerprint": llama_target.fingerprint()}
    exported = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target),
                           training=record)
    monkeypatch.setattr(FrozenTarget, "load", never_loaded)
    args = [*tiny_inference(exported, tmp_path / "out"), f"target={other}"]
    line = one_line_error(*run_in_process("inference", args, monkeypatch))
    assert f"{exported} was trained for target {llama_dir}, not for target {other}: " in line
    assert "hidden size 32 (drafter) vs 48 (target)" in line
    assert f"vocabulary size {len(tokenizer)} (drafter) vs {len(tokenizer) + 64} (target)" in line
    assert "feature layer ids [0, 1, 2] (drafter) vs a target of 2 layers" in line


def test_a_gguf_target_of_other_sizes_is_refused_from_its_header(llama_target, make_drafter, tokenizer, tmp_path,
                                                                 monkeypatch):
    """No training record: the drafter does not fit; the file's header says so, before any conversion."""
    from conftest import make_model
    from test_gguf_quant import write_gguf
    from test_reliability import one_line_error, run_in_process, tiny_inference

    from speculators.target import FrozenTarget

    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "two-layers.gguf", make_model("llama", tokenizer, num_layers=2), tokenizer)
    exported = export.save(make_drafter(llama_target), tmp_path / "export", export.Verifier.of(llama_target))
    monkeypatch.setattr(FrozenTarget, "load", never_loaded)
    args = [*tiny_inference(exported, tmp_path / "out"), f"target={gguf}"]
    line = one_line_error(*run_in_process("inference", args, monkeypatch))
    assert line.endswith(f"{exported} does not fit target {gguf}: "
                         f"feature layer ids [0, 1, 2] (drafter) vs a target of 2 layers")
    assert not (tmp_path / "cache").exists()  # not converted
