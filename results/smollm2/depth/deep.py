"""A deeper EAGLE-3 drafter, measured before speculators/eagle3.py grows one: the shipped layer, then
plain Llama decoder layers that read the hidden state alone (H wide; the layout vLLM's llama_eagle3 serves
for num_hidden_layers > 1). `drafter.start_from` copies an export into the first layer and zeroes the new
layers' o_proj and down_proj, so the drafter starts computing what that export does.

In this process the eagle3 family is this class (one layer unless drafter.num_layers says more), then the
project's own command runs:

    python results/smollm2/depth/deep.py train.py <train.py overrides> +drafter.num_layers=2 \
        +drafter.start_from=models/smollm2-eagle3
    python results/smollm2/depth/deep.py benchmarks.compare <benchmarks.compare overrides>
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from speculators import export
from speculators.drafter import FAMILIES
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from speculators.layers import LayerCaches, cached_layer, ttt_attention
from speculators.peagle import PEagleDecoderLayer as PlainLayer  # a Llama decoder layer over the hidden state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # results/smollm2/patched.py
from patched import run_command  # noqa: E402


@dataclass
class DeepEagle3Config(Eagle3Config):
    num_layers: int = 1  # decoder layers: EAGLE-3's own, then num_layers - 1 plain ones
    start_from: str | None = None  # an export whose weights the first layer (and the rest of the drafter) start from


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
        return LayerCaches.of(self.layer_cfg, len(self.layers), batch, max_len, device)

    @torch.no_grad()
    def step(self, cache, tokens, hidden, positions=None, visible=None):
        residual, x = self.layers[0].attention_input(self.embed_tokens(tokens), hidden)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if i:
                residual, x = layer.attention_input(None, hidden)
            hidden = cached_layer(layer, self.rotary_table, layer_cache, residual, x, positions, visible)
        hidden = self.carried(hidden)
        return self.logits(hidden), hidden


def main():
    FAMILIES["eagle3"] = DeepEagle3Drafter  # served and exported as EAGLE-3 with more layers, as vLLM reads them
    run_command(sys.argv[1:])


if __name__ == "__main__":
    main()
