"""A drafter family written the way a user adds one: this file and conf/conf/toyfam.yaml, nothing else
(tests/test_new_family.py trains, exports and serves it). Defining the class registers the family
`toyfam`; its module has the same name, so `drafter.family=toyfam` finds it on the Python path.

The drafter: fc([embed(token); the target's last hidden state]) -> one Llama decoder layer -> lm_head
over a draft vocabulary, trained on the target's next-token distribution one position ahead, served as
a chain. Everything but its loss comes from speculators.layers and speculators.drafter.
"""

from dataclasses import dataclass

import torch
from torch import nn

from forge_kernels import distill_loss
from speculators import layers
from speculators.drafter import ChainDrafter


@dataclass
class ToyConfig:
    family: str = "toyfam"
    depth: int = 3
    draft_vocab_size: int = 64


class ToyDrafter(ChainDrafter):
    family = "toyfam"
    config_class = ToyConfig
    export_formats = ("speculators",)

    def __init__(self, cfg: ToyConfig, layer_cfg, target_hidden_size: int):
        super().__init__()
        H, N = self.add_target_parts(cfg, layer_cfg, [])
        self.fc = nn.Linear(H + target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList([layers.LlamaDecoderLayer(layer_cfg, H)])
        self.lm_head = nn.Linear(H, N, bias=False)
        self.rotary_table = layers.RotaryTable(layer_cfg)

    @classmethod
    def from_target(cls, cfg, target, token_counts):
        drafter = cls(cfg, layers.layer_config(target), target.hidden_size)
        drafter.start_from_target(target, token_counts, cfg.draft_vocab_size)
        return drafter

    @classmethod
    def from_speculators_config(cls, config, layer_cfg):
        return cls(ToyConfig(depth=config["trained_depth"], draft_vocab_size=config["draft_vocab_size"]), layer_cfg,
                   config["target_hidden_size"])

    def speculators_extra_config(self) -> dict:
        return {"target_hidden_size": self.target_hidden_size}

    @property
    def target_hidden_size(self) -> int:
        return self.fc.in_features - self.layer_cfg.hidden_size

    def features(self, target_out):
        return target_out.last_hidden

    def new_cache(self, batch, max_len, device=None):
        return layers.KVCache.of(self.layer_cfg, batch, max_len, device)

    def step(self, cache, tokens, hidden, positions=None, visible=None):
        x = self.fc(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))
        out = layers.cached_layer(self.layers[0], self.rotary_table, cache, x, x, positions, visible)
        return self.lm_head(out), out

    def training_loss(self, target_out, input_ids, loss_mask):
        """Position t reads token t+1 and the target's state at t, and learns its distribution at t+1."""
        layer, T = self.layers[0], input_ids.shape[1]
        x = self.fc(torch.cat([self.embed_tokens(layers.shift_left(input_ids, 1)), target_out.last_hidden], dim=-1))
        cos, sin = (table[:T] for table in self.rotary_table(T, x.device))
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        logits = self.lm_head(layer.finish(x, layers.ttt_attention(q, [k], [v])))  # one step: causal attention
        counted = layers.shift_left(loss_mask, 2).bool()
        per_position = distill_loss(logits, target_out.full_logits(), self.draft_to_target, counted, kind="soft_ce", shift=1)
        hits = (self.draft_to_target[logits.argmax(-1)] == layers.shift_left(target_out.argmax(), 1)) & counted
        accuracy = hits.sum() / counted.sum().clamp(min=1)
        return per_position.sum() / counted.sum().clamp(min=1), {f"acc_step{j}": accuracy for j in range(self.depth)}
