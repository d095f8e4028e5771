"""DFlash, block drafting (Chen et al. 2026, arXiv:2602.06036): model, anchor-block training, loss and config.

One drafter pass proposes a whole block. The block is [anchor, MASK x (B-1)] at rotary positions
a..a+B-1, the anchor being the token the target just produced at position a; slot k >= 1 drafts the
token at a+k. The target's features enter as context, never as input tokens: the outputs of the target
layers `layer_ids`, concatenated, through fc (n*H -> H, no bias) and `hidden_norm`, are projected by
every draft layer's k_proj / v_proj (with k_norm and RoPE at their own positions, no input norm) into
extra keys and values. Queries come from the block only, and a block sees the context before its
anchor and its whole block both ways (no causal mask inside it). The draft layers are Qwen3's (q_norm
and k_norm per head); embeddings and lm_head are the target's, frozen (lm_head restricted to a draft
vocabulary, d2t/t2d). The mask token's embedding is learned (speculators/mask_token.py).

Training: `anchors` blocks per sequence in one pass, at random positions whose first draft is
loss-masked (a fixed draw in eval mode). Each block's queries see the context strictly before its
anchor and its own block, never another block. Slot 0 has weight 0; slot k >= 1 learns the target's
distribution for the token at a+k (its logits at a+k-1), weighted exp(-(k-1)/gamma).

Serving (drafting_kind "parallel", inference.drafting.ParallelProposer): `draft` appends the verified
positions' context keys to every layer's cache and runs the block once; the block is never cached.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from common.config import UserError, at_least, one_of, require
from forge_kernels import distill_loss
from forge_kernels.distill import KINDS
from speculators.drafter import ParallelDrafter
from speculators.layers import LayerCaches, RMSNorm, RotaryTable, SwiGLU, apply_rotary
from speculators.mask_token import MaskEmbedding
from speculators.target import FrozenTarget, TargetOutput


@dataclass
class DFlashConfig:
    family: str = "dflash"
    block_size: int = 8  # B: the anchor and B-1 mask slots; one pass drafts B-1 tokens (ModelOpt 8, speculators 16)
    num_layers: int = 5  # draft decoder layers: the references' for 8B targets (the CPU recipes train 1)
    draft_vocab_size: int = 32768
    anchors: int = 32  # blocks trained per sequence in one pass
    gamma: float | None = None  # slot k's loss weight exp(-(k-1)/gamma); null: 7 for block_size >= 16, else 4
    mask_token_id: int | None = None  # null: the least frequent token of the training data
    loss: str = "soft_ce"  # distillation loss (kernels/distill.py): soft_ce | kl (one gradient) | lk | lk_hybrid

    def __post_init__(self):
        at_least(2, drafter__block_size=self.block_size)
        at_least(1, drafter__num_layers=self.num_layers, drafter__draft_vocab_size=self.draft_vocab_size,
                 drafter__anchors=self.anchors)
        require(self.gamma is None or self.gamma > 0, "drafter.gamma", self.gamma, "> 0, or null")
        if self.mask_token_id is not None:
            at_least(0, drafter__mask_token_id=self.mask_token_id)
        one_of("drafter.loss", self.loss, KINDS)

    @property
    def depth(self) -> int:
        return self.block_size - 1

    def slot_weight(self, slot: int) -> float:
        gamma = self.gamma or (7.0 if self.block_size >= 16 else 4.0)
        return math.exp(-(slot - 1) / gamma)


class DFlashAttention(nn.Module):
    """Qwen3 attention (q_norm, k_norm per head) whose keys and values come from the block and the context."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return apply_rotary(self.q_norm(self.q_proj(x).view(B, T, self.heads, self.head_dim)).transpose(1, 2), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated keys and values [B, heads, T, d] of x [B, T, H] (kv heads repeated for GQA)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        group = self.heads // self.kv_heads
        return apply_rotary(k.repeat_interleave(group, dim=1), cos, sin), v.repeat_interleave(group, dim=1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, hidden: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """The block's hidden states [B, Q, H] after attending to the context's keys and its own."""
        x = self.input_layernorm(hidden)
        q = self.self_attn.queries(x, cos, sin)
        k, v = self.self_attn.keys_values(x, cos, sin)
        attn = F.scaled_dot_product_attention(q, torch.cat([context_keys, k], 2), torch.cat([context_values, v], 2),
                                              attn_mask=visible)
        B, _, Q, _ = attn.shape
        h = hidden + self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, Q, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(MaskEmbedding, ParallelDrafter):
    family = "dflash"
    config_class = DFlashConfig
    export_formats = ("speculators", "dflash")
    drafts_beyond_depth = False  # a block holds block_size - 1 drafts

    def __init__(self, cfg: DFlashConfig, layer_cfg: LlamaConfig, layer_ids: list[int], target_hidden_size: int):
        super().__init__()
        H, N = self.add_target_parts(cfg, layer_cfg, layer_ids)
        require(cfg.block_size < layer_cfg.max_position_embeddings, "drafter.block_size", cfg.block_size,
                f"below the target's context of {layer_cfg.max_position_embeddings} positions")
        self.add_mask_embedding(H)
        self.fc = nn.Linear(len(layer_ids) * target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, layer_cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(layer_cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(H, layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False).requires_grad_(False)  # the target's rows, frozen
        self.rotary_table = RotaryTable(layer_cfg)

    @classmethod
    def from_target(cls, cfg: DFlashConfig, target: FrozenTarget, token_counts: torch.Tensor) -> "DFlashDrafter":
        if not target.layer_ids:
            raise UserError("DFlash reads target features: target.layer_ids must name at least one layer")
        return cls.with_mask_token_from_target(cfg, target, token_counts)

    @classmethod
    def from_speculators_config(cls, config: dict, layer_cfg: LlamaConfig) -> "DFlashDrafter":
        """An empty drafter shaped by an export's config.json (speculators.export reads the weights)."""
        cfg = DFlashConfig(block_size=config["block_size"], num_layers=layer_cfg.num_hidden_layers,
                           draft_vocab_size=config["draft_vocab_size"], mask_token_id=config["mask_token_id"])
        return cls(cfg, layer_cfg, config["aux_hidden_state_layer_ids"], config["target_hidden_size"])

    def speculators_extra_config(self) -> dict:
        """speculators' DFlash keys; the draft layers are Qwen3's."""
        layer = self.layer_cfg.to_dict() | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                            "num_hidden_layers": len(self.layers), "vocab_size": len(self.t2d)}
        return {"block_size": self.cfg.block_size, "aux_hidden_state_layer_ids": self.layer_ids,
                "mask_token_id": self.cfg.mask_token_id, "target_hidden_size": self.target_hidden_size,
                "transformer_layer_config": layer}

    @property
    def target_hidden_size(self) -> int:
        return self.fc.in_features // len(self.layer_ids)

    def features(self, target_out: TargetOutput) -> torch.Tensor:
        """The context of verified positions: hidden_norm(fc(target layers' outputs))."""
        return self.hidden_norm(self.fc(torch.cat(target_out.aux_hidden, dim=-1)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


    # --- training ---------------------------------------------------------------------------------

    def sample_anchors(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchors [B, A], valid [B, A]): positions a >= 1 whose token a+1 is loss-masked, drawn
        without replacement; a fixed draw in eval mode, so validation compares like with like."""
        B, T = loss_mask.shape
        candidates = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
        candidates[:, 1 : T - 1] = loss_mask[:, 2:].bool()
        generator = None if self.training else torch.Generator(loss_mask.device).manual_seed(0)
        scores = torch.rand(B, T, generator=generator, device=loss_mask.device).masked_fill(~candidates, -1.0)
        top, anchors = scores.topk(min(self.cfg.anchors, T), dim=1)
        return anchors, top >= 0

    def block_forward(self, context: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, A, block_size, H] of the blocks at `anchors` [B, A], each seeing the
        context [B, T, H] before its anchor and its own block."""
        B, T = input_ids.shape
        A, S = anchors.shape[1], self.cfg.block_size
        slots = torch.arange(S, device=input_ids.device)
        tokens = torch.where(slots == 0, input_ids.gather(1, anchors)[..., None], self.cfg.mask_token_id)
        cos, sin = (t[:, None] for t in self.rotary_table.at((anchors[..., None] + slots).view(B, A * S)))
        context_cos, context_sin = self.rotary_table.at(torch.arange(T, device=input_ids.device))
        block = torch.arange(A, device=input_ids.device).repeat_interleave(S)
        sees_context = torch.arange(T, device=input_ids.device) < anchors.repeat_interleave(S, dim=1)[..., None]
        sees_block = (block[:, None] == block[None, :]).expand(B, -1, -1)
        visible = torch.cat([sees_context, sees_block], dim=2)[:, None]  # [B, 1, A*S, T + A*S]
        hidden = self.embed(tokens).view(B, A * S, -1)
        for layer in self.layers:
            keys, values = layer.self_attn.keys_values(context, context_cos, context_sin)
            hidden = layer(hidden, keys, values, cos, sin, visible)
        return hidden.view(B, A, S, -1)

    first_slot = 1  # the first slot that drafts: the anchor's own slot only carries the token just emitted

    def block_targets(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """The blocks of one batch and what their drafting slots learn: (hidden [B, A, S', H] of the slots
        first_slot..S-1, drafted positions [B, A, S'], counted [B, A, S'] (an anchor drawn and the token
        loss-masked), batch index [B, A, S'], the target's argmax for each drafted token [B, A, S'])."""
        T = input_ids.shape[1]
        anchors, valid = self.sample_anchors(loss_mask)
        hidden = self.block_forward(self.features(target_out), input_ids, anchors)[:, :, self.first_slot :]
        slots = torch.arange(self.first_slot, self.cfg.block_size, device=input_ids.device)
        drafted = anchors[..., None] + slots + (1 - self.first_slot)  # slot k drafts anchor + k (+1 from the anchor)
        at = drafted.clamp(max=T - 1)
        counted = valid[..., None] & (drafted < T) & loss_mask.gather(1, at.flatten(1)).view_as(at).bool()
        batch = torch.arange(len(input_ids), device=input_ids.device)[:, None, None].expand_as(at)
        return hidden, at, counted, batch, target_out.argmax()[batch, at - 1]

    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """Weighted sum over slots k >= 1 of the soft cross-entropy to the target's renormalised
        draft-vocab distribution for the token at anchor+k; metrics loss_step{j} and acc_step{j}
        (draft argmax == target argmax) for draft j = slot j+1."""
        hidden, at, counted, batch, target_argmax = self.block_targets(target_out, input_ids, loss_mask)
        rows = counted.nonzero(as_tuple=True)
        logits = self.logits(hidden[rows])
        target_logits = target_out.logits_at(self.draft_to_target)[batch[rows], at[rows] - 1]
        return self.slot_losses(logits, target_logits, self.t2d[target_argmax[rows]], target_argmax[rows], rows[2])

    def slot_losses(self, logits, target_logits, trained, target_argmax, slot) -> tuple[torch.Tensor, dict]:
        """The weighted sum over draft positions of the distillation loss of rows `logits` [n, N] (draft j's rows:
        slot == j), and metrics loss_step{j}, acc_step{j}."""
        per_slot = distill_loss(logits, target_logits, torch.arange(logits.shape[-1], device=logits.device),
                                trained, kind=self.cfg.loss)
        hits = self.draft_to_target[logits.argmax(-1)] == target_argmax
        loss, metrics = 0.0, {}
        for j in range(self.depth):
            here = slot == j
            step_loss = (per_slot * here).sum() / (trained & here).sum().clamp(min=1)
            loss = loss + self.cfg.slot_weight(j + 1) * step_loss
            metrics[f"loss_step{j}"] = step_loss.detach()
            metrics[f"acc_step{j}"] = (hits & here).sum() / here.sum().clamp(min=1)
        return loss, metrics

    # --- serving ----------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int, device=None) -> LayerCaches:
        """Every layer's context keys and values; blocks are never cached."""
        return LayerCaches.of(self.layer_cfg, len(self.layers), batch, max_len, device)

    def block_hidden(self, cache: LayerCaches, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Append m verified positions (`features` [1, m, H]; tokens [1, m], the last being the anchor
        at position cache.length + m) to the context and run the block [anchor, MASK x (S-1)] once:
        its hidden states [S, H]."""
        start, m, S = cache.length, tokens.shape[1], self.cfg.block_size
        context_cos, context_sin = self.rotary_table.at(torch.arange(start, start + m, device=tokens.device))
        cos, sin = self.rotary_table.at(torch.arange(start + m, start + m + S, device=tokens.device))
        block = torch.cat([tokens[:, -1:], tokens.new_full((1, S - 1), self.cfg.mask_token_id)], dim=1)
        x = self.embed(block)
        for layer, layer_cache in zip(self.layers, cache):
            keys, values = layer_cache.append(*layer.self_attn.keys_values(hidden, context_cos, context_sin))
            x = layer(x, keys, values, cos, sin, None)
        return x[0]

    def check_k(self, k: int) -> None:
        if k > self.depth:
            raise UserError(f"k={k}: a {type(self).__name__} with block_size={self.cfg.block_size} "
                            f"drafts at most {self.depth} tokens per pass")

    @torch.no_grad()
    def draft(self, cache: LayerCaches, tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Draft k <= block_size - 1 tokens in one pass of the whole block (block_hidden): draft-vocab
        logits [k, N] of slots 1..k."""
        self.check_k(k)
        return self.logits(self.block_hidden(cache, tokens, hidden)[1 : k + 1])
