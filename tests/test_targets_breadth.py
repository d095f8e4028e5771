"""Targets beyond the dense Llama family, built tiny and random from their configs (2 layers, hidden 64):
MoE targets under quant=int8 (routers left alone, fused experts int8, the precision breakdown right,
speculation lossless against the quantized target's own decoding)."""

import warnings

import pytest
import torch
from test_engine import MAX_NEW, prompts_of
from torch import nn
from transformers import Llama4ForCausalLM, Llama4TextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from inference.engine import check_pair, generate
from speculators.layers import DecodingLinear
from speculators.quant import QuantConfig, WeightOnlyInt8Linear, describe, precision_breakdown, weight_bytes
from speculators.self_draft import SelfDrafter
from speculators.target import FrozenTarget, TargetConfig

FEATURES = [0, 1]  # two layers: explicit feature ids


def tiny_config(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def moe_model(family: str, tokenizer) -> nn.Module:
    torch.manual_seed(0)
    common = tiny_config(tokenizer)
    if family == "llama4":  # a chunk shorter than the prompts, as in Llama-4's chunked attention
        return Llama4ForCausalLM(Llama4TextConfig(**common, intermediate_size=128, intermediate_size_mlp=128,
                                                  num_local_experts=4, num_experts_per_tok=1,
                                                  interleave_moe_layer_step=1, attention_chunk_size=8))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=64,
                                              num_experts=8, num_experts_per_tok=2))


@pytest.fixture(scope="module", params=["llama4", "qwen3_moe"])
def moe_dir(request, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    moe_model(request.param, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load(path, **quant) -> FrozenTarget:
    return FrozenTarget.load(TargetConfig(name_or_path=str(path), layer_ids=FEATURES), QuantConfig(**quant))


def expected_int8_share(model: nn.Module) -> tuple[float, float]:
    """(linears but lm_head and routers, fused experts) as shares of every weight, from the fp32 model."""
    total = sum(p.numel() for p in model.parameters())
    linears = sum(m.weight.numel() for m in model.modules() if type(m) in (nn.Linear, DecodingLinear))
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    head = model.get_output_embeddings().weight.numel()
    return (linears - head + experts) / total, experts / total


def test_moe_int8_quantizes_experts_leaves_routers_and_says_the_breakdown(moe_dir):
    full = load(moe_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # int8 leaves too few weights unquantized to warn
        int8 = load(moe_dir, scheme="int8")
    share, experts = expected_int8_share(full.model)
    breakdown = precision_breakdown(int8.model)
    assert set(breakdown) == {"int8", "fp32"}
    assert breakdown["int8"]["share"] == pytest.approx(share) and breakdown["int8"]["experts"] == pytest.approx(experts)
    assert breakdown["fp32"]["experts"] == 0 and 0.5 < experts < share
    assert describe(breakdown).startswith(f"int8: {share:.0%} of weights (experts: {experts:.0%}); fp32: ")
    assert describe(precision_breakdown(full.model)) == f"fp32: 100% of weights (experts: {experts:.0%})"
    routers = [m for m in int8.model.modules() if "Router" in type(m).__name__]
    assert routers and all(m.weight.dtype == torch.float32 for m in routers)  # Llama4Router subclasses nn.Linear
    assert not any(p.dim() == 3 for p in int8.model.parameters())  # no fp32 expert copy outlives a forward
    assert weight_bytes(int8.model) < 0.4 * weight_bytes(full.model)
    assert any(isinstance(m, WeightOnlyInt8Linear) for m in int8.model.modules())


def test_moe_int8_logits_stay_near_and_speculation_is_lossless(moe_dir, text_batch):
    full, int8 = load(moe_dir), load(moe_dir, scheme="int8")
    ids = text_batch[:1, :20]
    a, b = full(ids).logits, int8(ids).logits
    assert 0 < float((a - b).norm() / a.norm()) < 0.2  # the experts' levels are per expert and output channel
    with pytest.warns(UserWarning, match=r"quant.scheme=int4 left \d+% of the target's weights unquantized .*experts"):
        int4 = load(moe_dir, scheme="int4", group_size=16)  # int4 keeps experts as loaded: said at load
    copy = SelfDrafter.of(int4, "int4", "int8", 3)
    check_pair(int8, copy)
    for prompt in prompts_of(text_batch):
        alone = generate(int8, None, prompt, MAX_NEW, k=0).tokens
        spec = generate(int8, copy, prompt, MAX_NEW, k=3)
        assert spec.tokens == alone
        assert spec.stats.num_accepted_tokens > 0
