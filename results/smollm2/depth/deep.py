"""A deeper EAGLE-3 drafter, measured before speculators/eagle3.py grows one: the shipped layer, then
plain Llama decoder layers that read the hidden state alone (H wide; the layout vLLM's llama_eagle3 serves
for num_hidden_layers > 1). `drafter.start_from` copies an export into the first layer and zeroes the new
layers' o_proj and down_proj, so the drafter starts computing what that export does.

In this process the eagle3 family is this class (one layer unless drafter.num_layers says more), then the
project's own command runs:

    python results/smollm2/depth/deep.py train.py <train.py overrides> +drafter.num_layers=2 \
        +drafter.start_from=models/smollm2-eagle3
    python results/smollm2/depth/deep.py inference.compare <inference.compare overrides>
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speculators import export, families
from speculators.eagle3 import Eagle3Attention, Eagle3Config, Eagle3DecoderLayer, Eagle3Drafter, ttt_attention
from speculators.layers import KVCache, RMSNorm, SwiGLU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/smollm2/patched.py
from patched import run_command  # noqa: E402


@dataclass
class DeepEagle3Config(Eagle3Config):
    num_layers: int = 1  # decoder layers: EAGLE-3's own, then num_layers - 1 plain ones
    start_from: str | None = None  # an export whose weights the first layer (and the rest of the drafter) start from


class PlainLayer(nn.Module):
    """A Llama decoder layer over the hidden state (pre-norm attention and MLP, residual around each)."""

    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    finish = Eagle3DecoderLayer.finish  # o_proj, residual add and MLP, as EAGLE-3's own layer


class LayerCaches:
    """One KVCache per layer behind KVCache's interface (length, crop)."""

    def __init__(self, caches):
        self.caches = caches

    @property
    def length(self):
        return self.caches[0].length

    def crop(self, length):
        for cache in self.caches:
            cache.crop(length)


class DeepEagle3Drafter(Eagle3Drafter):
    config_class = DeepEagle3Config

    def __init__(self, cfg, layer_cfg, layer_ids, target_hidden_size):
        super().__init__(cfg, layer_cfg, layer_ids, target_hidden_size)
        self.layers.extend(PlainLayer(layer_cfg) for _ in range(cfg.num_layers - 1))

    @classmethod
    def from_target(cls, cfg, target, token_counts):
        drafter = super().from_target(cfg, target, token_counts)
        if cfg.start_from:
            saved, _ = export.load(cfg.start_from)
            export.share_target_embedding(saved, target)
            missing, unexpected = drafter.load_state_dict(saved.state_dict(), strict=False)
            assert not unexpected and all(name.startswith("layers.") and not name.startswith("layers.0.")
                                          for name in missing), (missing, unexpected)
            with torch.no_grad():
                for layer in drafter.layers[1:]:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
        return drafter

    @classmethod
    def from_speculators_config(cls, config, layer_cfg):
        one = Eagle3Drafter.from_speculators_config(config, layer_cfg)
        cfg = DeepEagle3Config(**vars(one.cfg) | {"num_layers": layer_cfg.num_hidden_layers})
        return cls(cfg, one.layer_cfg, one.layer_ids, one.target_hidden_size)

    def ttt_pass(self, tokens, hidden, keys, values, cos, sin):
        hidden = super().ttt_pass(tokens, hidden, keys, values, cos, sin)
        for i, layer in enumerate(self.layers[1:], 1):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(hidden), cos, sin)
            keys[i].append(k)
            values[i].append(v)
            hidden = layer.finish(hidden, ttt_attention(q, keys[i], values[i]))
        return hidden

    def new_cache(self, batch, max_len, device=None):
        c = self.layer_cfg
        return LayerCaches([KVCache(batch, c.num_attention_heads, max_len, c.head_dim, device) for _ in self.layers])

    @torch.no_grad()
    def step(self, cache, tokens, hidden, positions=None, visible=None):
        caches, start, m = cache.caches, cache.length, tokens.shape[1]
        residual, x = self.layers[0].attention_input(self.embed_tokens(tokens), hidden)
        hidden = self.cached_layer(caches[0], residual, x, positions, visible)
        if positions is None:
            cos, sin = (table[start : start + m] for table in self.rotary_table(start + m))
            visible = torch.arange(start + m)[None, :] <= torch.arange(start, start + m)[:, None]
        else:
            cos, sin = (table[positions] for table in self.rotary_table(int(positions.max()) + 1))
        for layer, layer_cache in zip(self.layers[1:], caches[1:]):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(hidden), cos, sin)
            keys, values = layer_cache.append(k, v)
            hidden = layer.finish(hidden, F.scaled_dot_product_attention(q, keys, values, attn_mask=visible))
        hidden = self.carried(hidden)
        return self.logits(hidden), hidden


def main():
    families.FAMILIES["eagle3"] = DeepEagle3Drafter
    run_command(sys.argv[1:])


if __name__ == "__main__":
    main()
