"""EAGLE-3 (Li et al. 2025, arXiv:2503.01840): model, training-time test, loss and config.

The drafter reads three target layers (low, mid, high), fuses them with fc(3H -> H), and
runs one decoder layer whose attention input is concat(input_layernorm(embed(token)),
hidden_norm(h)), 2H wide; the residual carries h. Its own norm and lm_head predict over a
reduced draft vocabulary (d2t/t2d maps to the target's).

EAGLE-3.1 (speculators' flags of the same names): `fc_norm` puts an RMSNorm on each auxiliary hidden
state before fc (fc_norm.{i}), `norm_before_fc` one RMSNorm over their concatenation (input_norm), never
both; `norm_output` carries the hidden state after the final norm into the next step, the one the
lm_head reads (without it, the next step reads the layer's output before the norm).

Training-time test (TTT) unrolls the drafter `depth` times as it runs when serving.
At step j, position t reads token t+1+j (teacher-forced) and, for j > 0, its own previous
output as the hidden input; it is trained to match the target's distribution at t+1+j. Its
query sees the step-0 keys of positions <= t (the verified context) and the keys of
position t from steps 1..j (its own draft chain), at rotary position t+j.
"""

from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import LlamaConfig

from common.config import UserError, at_least, one_of, require
from forge_kernels import distill_loss
from forge_kernels.distill import KINDS
from speculators.drafter import ChainDrafter, eagle3_layout_keys, speculators_depth
from speculators.layers import (
    Eagle3DecoderLayer,
    KVCache,
    RMSNorm,
    RotaryTable,
    cached_layer,
    layer_config,
    shift_left,
    ttt_attention,
)
from speculators.target import FrozenTarget, TargetOutput


@dataclass
class Eagle3Config:
    family: str = "eagle3"
    depth: int = 5  # K: draft steps unrolled in training (training-time test; anchors use 3 to 7)
    step_decay: float = 0.8  # loss weight of step j is step_decay**j (EAGLE-3: 0.8)
    draft_vocab_size: int = 32768
    intermediate_size: int | None = None  # the layer's MLP width; None: the target's
    norm_before_residual: bool = False  # True: the residual carries hidden_norm(h) instead of h
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm per auxiliary hidden state before fc
    norm_before_fc: bool = False  # EAGLE-3.1: one RMSNorm over the concatenated hidden states before fc
    norm_output: bool = False  # EAGLE-3.1: the final norm's output is what the next draft step reads
    loss: str = "soft_ce"  # distillation loss (kernels/distill.py): soft_ce | kl (one gradient) | lk | lk_hybrid

    def __post_init__(self):
        at_least(1, drafter__depth=self.depth,
                 drafter__draft_vocab_size=self.draft_vocab_size)
        if self.intermediate_size is not None:
            at_least(1, drafter__intermediate_size=self.intermediate_size)
        require(self.step_decay > 0, "drafter.step_decay", self.step_decay, "> 0")
        one_of("drafter.loss", self.loss, KINDS)
        if self.fc_norm and self.norm_before_fc:
            raise UserError("drafter.fc_norm and drafter.norm_before_fc are two ways to normalise fc's input; set one")


EAGLE31_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")  # exported as config flags of these names


class Eagle3Drafter(ChainDrafter):
    family = "eagle3"
    config_class = Eagle3Config
    export_formats = ("speculators", "eagle3", "gguf")

    def __init__(self, cfg: Eagle3Config, layer_cfg: LlamaConfig, layer_ids: list[int], target_hidden_size: int):
        super().__init__()
        H, N = self.add_target_parts(cfg, layer_cfg, layer_ids)
        self.fc = nn.Linear(len(layer_ids) * target_hidden_size, H, bias=False)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(target_hidden_size, layer_cfg.rms_norm_eps) for _ in layer_ids])
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(len(layer_ids) * target_hidden_size, layer_cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(layer_cfg, cfg.norm_before_residual)])
        self.norm = RMSNorm(H, layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)
        self.rotary_table = RotaryTable(layer_cfg)  # serving-time cos/sin

    @classmethod
    def from_target(cls, cfg: Eagle3Config, target: FrozenTarget, token_counts: torch.Tensor) -> "Eagle3Drafter":
        """A drafter for `target`: its embeddings (frozen), its lm_head rows of the draft vocab as a start."""
        if not target.layer_ids:
            raise UserError("EAGLE-3 reads target features: target.layer_ids must name at least one layer "
                            "(null: the default [2, L//2, L-3])")
        layer_cfg = layer_config(target, cfg.intermediate_size)
        cfg = replace(cfg, intermediate_size=layer_cfg.intermediate_size)  # what an export's config.json reads back
        drafter = cls(cfg, layer_cfg, target.layer_ids, target.hidden_size)
        drafter.start_from_target(target, token_counts, cfg.draft_vocab_size)
        return drafter

    @classmethod
    def from_speculators_config(cls, config: dict, layer_cfg: LlamaConfig) -> "Eagle3Drafter":
        """An empty drafter shaped by an export's config.json (speculators.export reads the weights)."""
        cfg = Eagle3Config(depth=speculators_depth(config), draft_vocab_size=config["draft_vocab_size"],
                           intermediate_size=layer_cfg.intermediate_size,
                           norm_before_residual=config["norm_before_residual"],
                           **{flag: config.get(flag, False) for flag in EAGLE31_FLAGS})
        return cls(cfg, layer_cfg, config["eagle_aux_hidden_state_layer_ids"], config["target_hidden_size"])

    def speculators_extra_config(self) -> dict:
        return eagle3_layout_keys(self) | {flag: True for flag in self.eagle31_flags}

    @property
    def eagle31_flags(self) -> list[str]:
        return [flag for flag in EAGLE31_FLAGS if getattr(self.cfg, flag)]

    @property
    def target_hidden_size(self) -> int:
        return self.fc.in_features // len(self.layer_ids)

    def fuse(self, aux_hidden: list[torch.Tensor]) -> torch.Tensor:
        if self.cfg.fc_norm:
            aux_hidden = [norm(h) for norm, h in zip(self.fc_norm, aux_hidden)]
        x = torch.cat(aux_hidden, dim=-1)
        return self.fc(self.input_norm(x) if self.cfg.norm_before_fc else x)

    def carried(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads of the layer's output: normalised under norm_output."""
        return self.norm(hidden) if self.cfg.norm_output else hidden

    def logits(self, carried: torch.Tensor) -> torch.Tensor:
        return self.lm_head(carried if self.cfg.norm_output else self.norm(carried))

    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """Weighted sum over TTT steps of the soft cross-entropy to the target's distribution
        restricted to the draft vocab and renormalised (kernels.distill_loss, chunked: no full
        fp32 probability tensors).

        Returns (loss, metrics) with loss and accuracy (draft argmax == target argmax) per step.
        """
        T = input_ids.shape[1]
        target_argmax = target_out.argmax()
        in_draft_vocab = self.t2d[target_argmax]
        target_draft = target_out.logits_at(self.draft_to_target)  # [B, T, D], read once
        every_draft_id = torch.arange(target_draft.shape[-1], device=input_ids.device)
        hidden = self.fuse(target_out.aux_hidden)
        keys, values, loss, metrics = [[] for _ in self.layers], [[] for _ in self.layers], 0.0, {}
        for j in range(self.cfg.depth):
            tokens = shift_left(input_ids, 1 + j)
            # Position t is trained on the distribution at t+1+j, i.e. on predicting token t+2+j.
            counted = shift_left(loss_mask, 2 + j).bool()
            trained = counted & shift_left(in_draft_vocab, 1 + j)
            cos, sin = self.rotary_table.at(torch.arange(T, device=input_ids.device) + j)
            hidden = self.carried(self.ttt_pass(tokens, hidden, keys, values, cos, sin))
            # Only counted positions reach the lm_head (prompts and padding are half of a chat batch).
            rows, cols = counted.nonzero(as_tuple=True)
            logits = self.logits(hidden[rows, cols])
            per_position = distill_loss(logits, target_draft[rows, cols + 1 + j], every_draft_id, trained[rows, cols],
                                        kind=self.cfg.loss)
            step_loss = per_position.sum() / trained.sum().clamp(min=1)
            loss = loss + self.cfg.step_decay**j * step_loss
            hits = self.draft_to_target[logits.argmax(-1)] == target_argmax[rows, cols + 1 + j]
            metrics[f"loss_step{j}"] = step_loss.detach()
            metrics[f"acc_step{j}"] = hits.sum() / counted.sum().clamp(min=1)
        return loss, metrics

    def ttt_pass(self, tokens: torch.Tensor, hidden: torch.Tensor, keys: list[list[torch.Tensor]],
                 values: list[list[torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The decoder layer at one training-time-test step; keys[i]/values[i] collect layer i's keys and
        values of the steps so far, which later steps attend to (ttt_attention)."""
        layer = self.layers[0]
        residual, x = layer.attention_input(self.embed_tokens(tokens), hidden)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        keys[0].append(k)
        values[0].append(v)
        return layer.finish(residual, ttt_attention(q, keys[0], values[0]))

    def new_cache(self, batch: int, max_len: int, device=None) -> KVCache:
        return KVCache.of(self.layer_cfg, batch, max_len, device)

    def features(self, target_out: TargetOutput) -> torch.Tensor:
        """Hidden inputs of verified positions: the fused low/mid/high target features."""
        return self.fuse(target_out.aux_hidden)

    @torch.no_grad()
    def step(self, cache: KVCache, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
             visible: torch.Tensor | None = None):
        """Serve m positions appended after `cache`: tokens [B, m] and hidden inputs [B, m, H],
        which are `features` for verified positions, or the drafter's own previous output while
        it drafts. Returns draft-vocab logits and output hidden states. Positions default to
        the next m and attention to causal; a tree draft passes its nodes' depths as positions
        and `visible` [m, cache.length + m] (context and own ancestors). `cache.crop` undoes it.
        """
        residual, x = self.layers[0].attention_input(self.embed_tokens(tokens), hidden)
        hidden = self.carried(cached_layer(self.layers[0], self.rotary_table, cache, residual, x, positions, visible))
        return self.logits(hidden), hidden
