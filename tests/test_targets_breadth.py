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
    with pytest.warns(UserWarning, match=r"quant.scheme=int4 left \d+% of the target's layer weights unquantized .*experts"):
        int4 = load(moe_dir, scheme="int4", group_size=16)  # int4 keeps experts as loaded: said at load
    copy = SelfDrafter.of(int4, "int4", "int8", 3)
    check_pair(int8, copy)
    for prompt in prompts_of(text_batch):
        alone = generate(int8, None, prompt, MAX_NEW, k=0).tokens
        spec = generate(int8, copy, prompt, MAX_NEW, k=3)
        assert spec.tokens == alone
        assert spec.stats.num_accepted_tokens > 0


# --- multimodal checkpoints: the language model inside is the target ---------------------------------


def vision_model(family: str, tokenizer) -> nn.Module:
    """Gemma-3 as 4B-27B ship (AutoModelForCausalLM loads it) and Qwen2.5-VL (it does not: image-text-to-text);
    the text model's settings under text_config."""
    import transformers

    torch.manual_seed(0)
    text = {**tiny_config(tokenizer), "intermediate_size": 128}
    image, video, start = len(tokenizer), len(tokenizer) + 1, len(tokenizer) + 2  # beyond the text's tokens
    if family == "gemma3":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config={**text, "sliding_window": 8}, vision_config=vision, mm_tokens_per_image=4,
            image_token_index=image, boi_token_index=start, eoi_token_index=video))
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config={**text, "rope_parameters": rope}, vision_config=vision, image_token_id=image,
        video_token_id=video, vision_start_token_id=start))


@pytest.fixture(scope="module", params=["gemma3", "qwen2_5_vl"])
def vision_dir(request, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    vision_model(request.param, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_multimodal_checkpoint_is_its_language_model(vision_dir, text_batch):
    from common.config import UserError
    from speculators.target import TargetShape

    cfg = TargetConfig(name_or_path=str(vision_dir), layer_ids=FEATURES)
    shape = TargetShape.read(cfg)
    target = FrozenTarget.load(cfg)
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (2, 64, target.vocab_size)
    assert (target.num_layers, target.hidden_size) == (2, 64) and target.config is target.model.config.text_config
    ids = text_batch[:, :20]
    last_layer = {}
    hook = target.model.model.language_model.layers[-1].register_forward_hook(
        lambda module, args, output: last_layer.setdefault("out", output[0] if isinstance(output, tuple) else output))
    out = target(ids)
    hook.remove()
    with torch.no_grad():
        hf = target.model(input_ids=ids, output_hidden_states=True)
    for k, feature in zip(FEATURES, out.aux_hidden):
        torch.testing.assert_close(feature, hf.hidden_states[k])
    torch.testing.assert_close(out.logits, hf.logits)
    torch.testing.assert_close(target.final_norm(last_layer["out"]), out.last_hidden)  # the vLLM cache's path
    headless = FrozenTarget.load(cfg, layers=False)
    assert headless.num_layers == 2 and len(headless.model.model.language_model.layers) == 0
    torch.testing.assert_close(headless.from_hidden(out.aux_hidden, out.last_hidden).logits, out.logits)
    with pytest.raises(UserError, match=r"multimodal: .* text only, and these tokens hold an image"):
        target(torch.tensor([[1, 2, target.image_token_id]]))


def test_a_multimodal_checkpoint_serves_losslessly(vision_dir, make_drafter, text_batch):
    cfg = TargetConfig(name_or_path=str(vision_dir), layer_ids=FEATURES)
    target, int8 = FrozenTarget.load(cfg), FrozenTarget.load(cfg, QuantConfig("int8"))
    copy = SelfDrafter.of(int8, "int8", "none", 3)
    check_pair(target, copy)
    drafter = make_drafter(target)
    ids = text_batch[:, :24]
    loss, _ = drafter.training_loss(target(ids), ids, torch.ones_like(ids))  # trains from its features
    loss.backward()
    assert torch.isfinite(loss) and drafter.fc.weight.grad is not None
    for prompt in prompts_of(text_batch):
        alone = generate(target, None, prompt, MAX_NEW, k=0).tokens
        spec = generate(target, copy, prompt, MAX_NEW, k=3)
        assert spec.tokens == alone and spec.stats.num_accepted_tokens > 0
        assert generate(target, drafter, prompt, MAX_NEW, k=2).tokens == alone


# --- hybrid targets: linear-attention or state-space layers beside attention --------------------------


def hybrid_model(family: str, tokenizer) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = {**tiny_config(tokenizer), "intermediate_size": 128}
    if family == "lfm2":  # short convolutions
        return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            **{k: v for k, v in common.items() if k != "head_dim"}, layer_types=["conv", "full_attention"]))
    if family == "qwen3_next":  # gated delta-net linear attention, MoE
        return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **common, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32))
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(  # Mamba-2 layers
        **{k: v for k, v in common.items() if k != "head_dim"}, layer_types=["mamba", "attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32,
        mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16))


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next", "granitemoehybrid"])
def hybrid_dir(request, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hybrid_model(request.param, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_hybrid_session_rolls_its_states_back_exactly(hybrid_dir, text_batch):
    """Prefill, a verification, rejections that land inside a pass and on its start, one-token steps: every
    pass's outputs are those of the whole sequence so far computed without a cache (to 1e-4: Qwen3-Next's chunked
    delta rule over a whole sequence and its step-by-step recurrence sum in another order, 3e-5 apart)."""
    from inference.sessions import RecurrentSession, open_session

    target = FrozenTarget.load(TargetConfig(name_or_path=str(hybrid_dir), layer_ids=FEATURES))
    session = open_session(target, 64)
    assert target.recurrent and isinstance(session, RecurrentSession)
    tokens = text_batch[:1, :40]
    for step in (slice(0, 30), slice(30, 36), 33, slice(33, 34), slice(34, 38), 34, slice(34, 35), slice(35, 40)):
        if isinstance(step, int):  # reject every position from `step` on, as after a partly accepted draft
            session.crop(step)
            continue
        out, whole = session(tokens[:, step]), target(tokens[:, : step.stop])
        torch.testing.assert_close(out.logits, whole.logits[:, step], atol=1e-4, rtol=1e-4)
        for a, b in zip(out.aux_hidden, whole.aux_hidden):
            torch.testing.assert_close(a, b[:, step], atol=1e-4, rtol=1e-4)
    assert session.length == 40


def test_a_hybrid_target_serves_losslessly(hybrid_dir, make_drafter, text_batch):
    """Target-only decoding equals a no-cache greedy reference; speculation with a drafter that is mostly
    rejected (random EAGLE-3) and one mostly accepted (an int4 copy, itself hybrid) equals target-only."""
    from common.config import UserError
    from inference.engine import generate_batch

    cfg = TargetConfig(name_or_path=str(hybrid_dir), layer_ids=FEATURES)
    target = FrozenTarget.load(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # int4 leaves the experts as loaded: said at load
        copy = SelfDrafter.of(FrozenTarget.load(cfg, QuantConfig("int4", group_size=16)), "int4", "none", 3)
    drafter = make_drafter(target)
    batch = text_batch[:, :24]
    loss, _ = drafter.training_loss(target(batch), batch, torch.ones_like(batch))  # trains from its features
    assert torch.isfinite(loss)
    for prompt in prompts_of(text_batch):
        alone = generate(target, None, prompt, MAX_NEW, k=0).tokens
        ids = list(prompt)
        for _ in alone:
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
        assert alone == ids[len(prompt):]
        rejected = generate(target, drafter, prompt, MAX_NEW, k=3)
        assert rejected.tokens == alone and rejected.stats.num_accepted_tokens < rejected.stats.num_draft_tokens
        accepted = generate(target, copy, prompt, MAX_NEW, k=3)
        assert accepted.tokens == alone and accepted.stats.num_accepted_tokens > 0
    with pytest.raises(UserError, match=r"has recurrent layers .* serve it with batch_size=1"):
        generate_batch(target, drafter, prompts_of(text_batch), 8, k=3)


# --- targets whose served logits are not lm_head(final hidden state) ----------------------------------


def scaled_logits_model(family: str, tokenizer) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = {**tiny_config(tokenizer), "intermediate_size": 128}
    if family == "gemma2":  # a cap low enough to bite on a random target's logits
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, final_logit_softcapping=2.0,
                                                                        sliding_window=8))
    if family == "granite":
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0))
    return transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.25))


@pytest.mark.parametrize("family, described", [
    ("gemma2", "soft-caps its logits at final_logit_softcapping=2: c tanh(z / c)"),
    ("granite", "divides its logits by logits_scaling=4"),
    ("cohere", "multiplies its logits by logit_scale=0.25")])
def test_logits_recomputed_from_hidden_states_are_the_served_ones(family, described, tokenizer, text_batch):
    """A cache of hidden states recomputes the logits the target serves, through the property that changes them;
    a property left out is refused in one line naming what was applied."""
    from common.config import UserError
    from speculators.target import check_logits_from_hidden, describe_logits

    target = FrozenTarget(scaled_logits_model(family, tokenizer), tokenizer, family, FEATURES)
    assert describe_logits(target) == f"lm_head(final hidden state), then it {described}"
    out = target(text_batch[:, :16])
    plain = target.model.get_output_embeddings()(out.last_hidden)
    assert not torch.allclose(plain, out.logits, atol=1e-3)  # the property changes what is served
    torch.testing.assert_close(target.from_hidden(out.aux_hidden, out.last_hidden).logits, out.logits)
    ids = torch.tensor([3, 50, 7])
    torch.testing.assert_close(target.head_logits(out.last_hidden, ids), out.logits[..., ids])
    check_logits_from_hidden(target, out, "train it with data.hidden_states=online")
    target.logit_transforms = []  # as if transformers added a property this project does not know
    with pytest.raises(UserError, match=r"^target \w+: its served logits are not lm_head\(final hidden state\); a "
                                        r"property .* train it with data.hidden_states=online$"):
        check_logits_from_hidden(target, out, "train it with data.hidden_states=online")


def test_a_logit_property_not_applied_is_named_without_a_forward(tokenizer):
    """What a cache through vLLM (hidden states alone) can check: properties head_logits applies pass, others that
    look like they change the logits are named."""
    from common.config import UserError
    from speculators.target import check_logits_known

    target = FrozenTarget(scaled_logits_model("granite", tokenizer), tokenizer, "granite", FEATURES)
    check_logits_known(target, "use data.cache_engine=transformers")
    target.config.output_multiplier = 0.2  # as MiniCPM-style configs scale theirs
    with pytest.raises(UserError, match=r"^target granite: output_multiplier=0.2 may change its served logits, which "
                                        r"this project recomputes as lm_head\(final hidden state\), then it divides its "
                                        r"logits by logits_scaling=4; use data.cache_engine=transformers$"):
        check_logits_known(target, "use data.cache_engine=transformers")
