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
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from kernels import distill_loss
from kernels.distill import KINDS
from speculators.config import UserError, at_least, one_of, require
from speculators.drafter import Drafter, speculators_depth
from speculators.layers import KVCache, RMSNorm, SwiGLU, apply_rotary, rope_theta, rotary
from speculators.target import FrozenTarget, TargetOutput


@dataclass
class Eagle3Config:
    family: str = "eagle3"
    depth: int = 5  # K: draft steps unrolled in training (training-time test; anchors use 3 to 7)
    step_decay: float = 0.8  # loss weight of step j is step_decay**j (EAGLE-3: 0.8)
    draft_vocab_size: int = 32000
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


def layer_config(target: FrozenTarget, intermediate_size: int | None = None) -> LlamaConfig:
    """The drafter's decoder layer: the target's attention and MLP shapes (the MLP as wide as
    `intermediate_size` when given), one layer, the target's vocab."""
    c = target.config
    return LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=intermediate_size or c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta(c)},
        num_hidden_layers=1, vocab_size=target.vocab_size, tie_word_embeddings=False,
    )


class Eagle3Attention(nn.Module):
    """Llama attention over inputs `in_features` wide: 2H in EAGLE-3 (embeddings and hidden
    side by side), H in EAGLE-1 (speculators.eagle)."""

    def __init__(self, c: LlamaConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q [B, heads, T, d] and k, v [B, heads, T, d] (kv heads repeated for GQA)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of TTT step j = len(keys) - 1, all tensors [B, heads, T, d].

    keys[0]/values[0] come from step 0 and are seen causally; keys[i] (i >= 1) from step i
    and are seen only at the query's own position (the diagonal). One fused attention over the
    steps' keys side by side, under that mask: it never materialises the scores, which cost more
    in copies and gradients than in arithmetic (about 1.7x faster than an explicit softmax on CPU).
    """
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                          attn_mask=ttt_mask(q.shape[2], len(keys), q.device))


def ttt_mask(T: int, steps: int, device) -> torch.Tensor:
    """[T, steps * T] bool: causal over step 0's keys, the diagonal of every later step's."""
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([mask, *[torch.eye(T, dtype=torch.bool, device=device)] * (steps - 1)], dim=1)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """(residual, 2H-wide attention input) for token embeddings and hidden states."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return residual, torch.cat([self.input_layernorm(embeds), normed], dim=-1)

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj, residual add and MLP; attn is [B, heads, T, d]."""
        B, _, T, _ = attn.shape
        h = residual + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(Drafter):
    config_class = Eagle3Config
    export_format = "speculators"
    speculators_model_type = "eagle3"
    drafting_kind = "autoregressive"  # served one step per draft token (inference.drafting)

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
        self._rotary = None  # serving-time cos/sin table (rotary_table)

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
        return eagle_speculators_keys(self) | {flag: True for flag in self.eagle31_flags}

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
        target_logits = target_out.logits
        target_argmax = target_logits.argmax(-1)
        in_draft_vocab = self.t2d[target_argmax]
        target_draft = target_logits.index_select(-1, self.draft_to_target)  # [B, T, D], read once
        every_draft_id = torch.arange(target_draft.shape[-1], device=input_ids.device)
        hidden = self.fuse(target_out.aux_hidden)
        keys, values, loss, metrics = [[] for _ in self.layers], [[] for _ in self.layers], 0.0, {}
        for j in range(self.cfg.depth):
            tokens = shift_left(input_ids, 1 + j)
            # Position t is trained on the distribution at t+1+j, i.e. on predicting token t+2+j.
            counted = shift_left(loss_mask, 2 + j).bool()
            trained = counted & shift_left(in_draft_vocab, 1 + j)
            cos, sin = rotary(torch.arange(T, device=input_ids.device) + j, self.layer_cfg.head_dim,
                              rope_theta(self.layer_cfg))
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

    def rotary_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, head_dim] of at least `length` positions, computed once per growth:
        while serving, every drafter call would otherwise rebuild them."""
        if self._rotary is None or len(self._rotary[0]) < length:
            positions = torch.arange(max(length, 1024), device=self.d2t.device)
            self._rotary = rotary(positions, self.layer_cfg.head_dim, rope_theta(self.layer_cfg))
        return self._rotary

    def new_cache(self, batch: int, max_len: int, device=None) -> KVCache:
        c = self.layer_cfg
        return KVCache(batch, c.num_attention_heads, max_len, c.head_dim, device)

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
        hidden = self.carried(self.cached_layer(cache, residual, x, positions, visible))
        return self.logits(hidden), hidden

    def cached_layer(self, cache: KVCache, residual: torch.Tensor, x: torch.Tensor, positions: torch.Tensor | None,
                     visible: torch.Tensor | None) -> torch.Tensor:
        """The decoder layer over m positions appended after `cache` (attention input x [B, m, *],
        residual [B, m, H]), as `step` describes positions and visibility; shared with EAGLE-1."""
        layer, start, m = self.layers[0], cache.length, x.shape[1]
        if positions is None:
            cos, sin = (table[start : start + m] for table in self.rotary_table(start + m))
            visible = torch.arange(start + m, device=x.device)[None, :] <= torch.arange(
                start, start + m, device=x.device)[:, None]
        else:
            cos, sin = (table[positions] for table in self.rotary_table(int(positions.max()) + 1))
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        keys, values = cache.append(k, v)
        return layer.finish(residual, F.scaled_dot_product_attention(q, keys, values, attn_mask=visible))


def eagle_speculators_keys(drafter) -> dict:
    """The speculators config keys of the EAGLE-3 layout (EAGLE-3 and P-EAGLE); EAGLE-3.1 flags off."""
    return {"target_hidden_size": drafter.target_hidden_size, "eagle_aux_hidden_state_layer_ids": drafter.layer_ids,
            "norm_before_residual": drafter.cfg.norm_before_residual,  # vLLM assumes true when absent
            "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros to x's length along dim 1: the value n positions ahead."""
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)
