"""A drafter's layer for unusual targets (speculators/layers.py layer_config): small shapes for MLA and very wide
targets, said in one line; the target's rope kind (linear, YaRN, Llama-3, Gemma-3's per layer type), or the rope
used instead, said."""

from types import SimpleNamespace

import pytest
import torch
import transformers
from test_architectures import LAYER_IDS, build

from speculators import export, layers
from speculators.eagle3 import Eagle3DecoderLayer
from speculators.layers import RotaryTable, layer_config
from speculators.target import FrozenTarget


@pytest.fixture(autouse=True)
def fresh_lines():
    """Each test sees the lines a drafter's first build says (say_once keeps them once per process)."""
    layers._said.clear()
    yield
    layers._said.clear()


def layer_of(config, vocab: int = 1000):
    return layer_config(SimpleNamespace(config=config, vocab_size=vocab))


def test_a_deepseek_v3_drafter_is_small_and_says_so(tokenizer, make_drafter, capsys):
    target = FrozenTarget(build("deepseek_v3", tokenizer), tokenizer, "deepseek_v3", LAYER_IDS)
    drafter = make_drafter(target)
    lc = drafter.layer_cfg
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim) == (4, 4, 16)  # hidden 64: heads of 64 / 4
    assert lc.intermediate_size == 2 * 64 and drafter.cfg.intermediate_size == 128  # the export records it
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("drafter layer")]
    assert said == ["drafter layer for this deepseek_v3 target: attention 4 heads x 16 (4 KV heads), not the "
                    "target's MLA (4 heads, kv_lora_rank 16) and an MLP 128 wide (2x hidden), not the target's 192, "
                    "as SpecForge and ModelOpt shape DeepSeek-V3 drafters (drafter.intermediate_size sets the MLP)"]
    make_drafter(target)  # built again (the export's copy): said once
    assert "drafter layer" not in capsys.readouterr().out


def test_at_deepseek_v3_scale_the_drafter_layer_is_half_what_copying_mla_made():
    """DeepSeek-V3's own config (7,168 hidden, 128 MLA heads, an 18,432-wide dense MLP), on the meta device: 56 heads of
    128 with 8 KV heads (SpecForge's) and an MLP 14,336 wide (ModelOpt's), 0.49B parameters; copying the target's
    shapes (128 heads of head_dim 64, 128 KV heads, the dense MLP) gave 0.81B, and 1.2B with fc and a 32k lm_head."""
    config = transformers.DeepseekV3Config()
    lc = layer_of(config)
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, lc.intermediate_size) == (56, 8, 128, 14336)
    with torch.device("meta"):
        small = sum(p.numel() for p in Eagle3DecoderLayer(lc, False).parameters())
        copied = transformers.LlamaConfig(**{**lc.to_dict(), "num_attention_heads": 128, "num_key_value_heads": 128,
                                             "head_dim": config.head_dim, "intermediate_size": 18432})
        copied = sum(p.numel() for p in Eagle3DecoderLayer(copied, False).parameters())
    assert 0.45e9 < small < 0.5e9 and copied > 0.8e9


def test_an_explicit_mlp_width_is_kept():
    lc = layer_config(SimpleNamespace(config=transformers.DeepseekV3Config(), vocab_size=10), 4096)
    assert lc.intermediate_size == 4096


def test_plain_targets_keep_their_shapes_and_say_nothing(target, capsys):
    lc = layer_config(target)
    c = target.config
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.intermediate_size) == (
        c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
    assert lc.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert capsys.readouterr().out == ""


def test_very_wide_targets_are_capped(capsys):
    """Queries wider than 2x hidden and an MLP wider than 4x hidden (Gemma-3 1B's is 6x) are the drafter's no more."""
    config = transformers.Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_attention_heads=32,
                                           num_key_value_heads=1, head_dim=256)
    lc = layer_of(config)
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, lc.intermediate_size) == (9, 3, 128, 4608)
    assert "not the target's 32 heads x 256 (8,192 wide, over 2x hidden)" in capsys.readouterr().out


def hf_cos_sin(lc, positions: torch.Tensor):
    """transformers' own rotary embedding of a Llama layer of the same rope parameters."""
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(lc)
    x = torch.zeros(1, len(positions), lc.head_dim)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("rope, said", [
    ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
      "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
     "drafter rope: yarn (factor 32, theta 150000), the target's"),  # gpt-oss
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
     "drafter rope: llama3 (factor 8, theta 500000), the target's"),  # Llama-3.1
])
def test_the_drafter_takes_the_targets_rope(rope, said, capsys):
    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       intermediate_size=64, max_position_embeddings=131072, rope_parameters=rope)
    lc = layer_of(config)
    assert lc.rope_parameters == rope
    assert capsys.readouterr().out.splitlines() == [said]
    positions = torch.arange(0, 5000, 7)
    cos, sin = RotaryTable(lc).at(positions)
    want_cos, want_sin = hf_cos_sin(lc, positions)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)
    table_cos, _ = RotaryTable(lc)(len(positions), "cpu")  # the serving table: the same rows
    torch.testing.assert_close(table_cos[positions[:10]], want_cos[:10])


def test_gemma3_rope_per_layer_type_is_its_full_attention_layers(capsys):
    config = transformers.Gemma3TextConfig(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    lc = layer_of(config)
    assert lc.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert capsys.readouterr().out.splitlines() == [
        "drafter rope: linear (factor 8, theta 1000000), the target's full-attention layers' (not its sliding layers' "
        "plain RoPE (theta 10000))"]
    positions = torch.arange(40)
    torch.testing.assert_close(RotaryTable(lc).at(positions)[0], hf_cos_sin(lc, positions)[0])


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 128, "rope_theta": 10000.0},
])
def test_a_rope_the_table_cannot_compute_is_plain_rope_and_said(rope, capsys):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, max_position_embeddings=256, rope_parameters=rope)
    lc = layer_of(config)
    assert lc.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert capsys.readouterr().out.splitlines() == [
        f"drafter rope: plain RoPE (theta 10000), plain RoPE instead of the target's {rope['rope_type']} (its "
        f"frequencies change with the sequence length)"]


def test_partial_rotary_and_heads_that_do_not_divide_hidden_are_said(capsys):
    """GLM-4.5's shape: 96 heads of 128 for hidden 5,120 (a Llama layer needs heads that divide it), half rotated."""
    lc = layer_of(transformers.Glm4MoeConfig(hidden_size=5120, num_attention_heads=96, head_dim=128,
                                             intermediate_size=12288))
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim, lc.intermediate_size) == (40, 8, 128, 12288)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("drafter layer for this glm4_moe target: attention 40 heads x 128 (8 KV heads), not "
                               "the target's 96 heads x 128 (12,288 wide, over 2x hidden), as SpecForge")
    assert lines[1:] == [
        "drafter rope: plain RoPE (theta 10000), the target's, rotating every dim of its heads (the target: 50%)"]


def test_a_yarn_drafter_exports_and_reloads_its_rope(tokenizer, make_drafter, tmp_path):
    target = FrozenTarget(build("gpt_oss", tokenizer), tokenizer, "gpt_oss", LAYER_IDS)
    drafter = make_drafter(target)
    assert drafter.layer_cfg.rope_parameters["rope_type"] == "yarn"
    back, _ = export.load(export.save(drafter, tmp_path / "export", export.Verifier.of(target)))
    assert back.layer_cfg.rope_parameters == drafter.layer_cfg.rope_parameters
    positions = torch.arange(30)
    torch.testing.assert_close(back.rotary_table.at(positions), drafter.rotary_table.at(positions))
    assert back.rotary_table.scale > 1  # YaRN's attention factor
