"""P-EAGLE, parallel drafting: model, conditional drop-token training, loss and config.

An EAGLE-3-style drafter that proposes all K draft tokens in one forward pass. Position t
reads token t+1 and the target's features of t, as in EAGLE; the drafter runs K depths
d = 0..K-1 at every anchor t:

    depth 0:      token x_{t+1}     hidden fc([h_low; h_mid; h_high]_t)   (the real features)
    depth d >= 1: mask_token_id     hidden fc(mask_hidden)                (both learned, shared)

at rotary position t+d; depth d is trained on the target's distribution at t+1+d (it
drafts token t+2+d). A query (t, d) sees the depth-0 keys of positions <= t and its own
chain (t, d') for d' <= d: the shape of EAGLE-3's training-time test, so
`layers.ttt_attention` computes it. No input of depth d depends on another depth's output,
so training computes every depth in one pass. mask_hidden [1, 1, n_aux*H] stands where the
target's concatenated features stand and goes through fc like them (speculators and vLLM do
the same: vLLM's proposer fuses it with the drafter's own fc).

Layers (as speculators and vLLM build multi-layer EAGLE-3 drafters): layer 0 is EAGLE-3's,
attention over concat(input_layernorm(embed), hidden_norm(h)), 2H wide, residual h; layers
1.. are plain Llama decoder layers over the hidden stream. Own final norm and lm_head over a
reduced draft vocabulary (d2t/t2d); the target's embeddings, frozen.

The mask token's embedding is learned. P-EAGLE has no separate embedding for it: it is row
mask_token_id of embed_tokens, which speculators trains with the whole table
(embed_requires_grad). Here only that row learns (speculators/mask_token.py), folded into
embed_tokens.weight in the state dict. The default mask token is the least frequent token of the
training data (the highest id among the unused ones, e.g. Qwen's padded rows beyond the tokenizer,
Llama-3's reserved tokens).

Conditional drop-token (COD) sampling keeps depth d >= 1 of an anchor with probability
p_d = max(r^d, r_min) (r = keep_ratio, r_min = min_keep), and only if depth d-1 of that
anchor is kept: one uniform u per anchor, kept at depth d iff u < p_d. p_d does not grow
with d, so the kept sets are nested and P(keep d | keep d-1) = p_d / p_{d-1}. Dropped rows
are not computed at all: the layers run over the kept (depth, anchor) rows only, and the
attention scatters them into per-depth [B, heads, T, d] tensors for ttt_attention (a kept
row's chain is kept, so no kept query reads a dropped row). Validation (eval mode) keeps
every row. The draws use the global torch RNG, which checkpoints restore.

Loss: the sum over depths, without decay, of the mean soft cross-entropy to the target's
distribution restricted to the draft vocab and renormalised (kernels.distill_loss), over
kept rows whose drafted token is loss-masked and whose target argmax is in the draft vocab.

Serving (drafting_kind "parallel"): `draft` appends the m verified positions to every
layer's cache and, in the same pass, k-1 mask positions after them with causal attention (a
single chain, so causal is the rule above); the logits of the last verified position and the
mask positions are the k drafts; the mask positions are then cropped from the caches.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from common.config import at_least, one_of, require
from forge_kernels import distill_loss
from forge_kernels.distill import KINDS
from speculators.drafter import ParallelDrafter, eagle3_layout_keys, speculators_depth
from speculators.layers import (
    Eagle3DecoderLayer,
    LayerCaches,
    LlamaDecoderLayer,
    RMSNorm,
    RotaryTable,
    shift_left,
    ttt_attention,
)
from speculators.mask_token import MaskEmbedding
from speculators.target import FrozenTarget, TargetOutput


@dataclass
class PEagleConfig:
    family: str = "peagle"
    depth: int = 5  # K: tokens drafted in one pass (depths 0..K-1)
    num_layers: int = 2  # decoder layers (P-EAGLE uses 2 to 4)
    draft_vocab_size: int = 32768
    keep_ratio: float = 0.7  # r: training keeps depth d >= 1 of a fraction max(r^d, min_keep) of anchors
    min_keep: float = 0.2  # r_min
    norm_before_residual: bool = False  # True: layer 0's residual carries hidden_norm(h) instead of h
    mask_token_id: int | None = None  # input token of depths >= 1; None: the least frequent token of the training data
    loss: str = "soft_ce"  # distillation loss (kernels/distill.py): soft_ce | kl (one gradient) | lk | lk_hybrid

    def __post_init__(self):
        at_least(1, drafter__depth=self.depth, drafter__num_layers=self.num_layers,
                 drafter__draft_vocab_size=self.draft_vocab_size)
        require(0 < self.keep_ratio <= 1, "drafter.keep_ratio", self.keep_ratio, "in (0, 1]")
        require(0 <= self.min_keep <= 1, "drafter.min_keep", self.min_keep, "in [0, 1]")
        if self.mask_token_id is not None:
            at_least(0, drafter__mask_token_id=self.mask_token_id)
        one_of("drafter.loss", self.loss, KINDS)

    def keep_probability(self, depth: int) -> float:
        return 1.0 if depth == 0 else max(self.keep_ratio**depth, self.min_keep)


class PEagleDecoderLayer(LlamaDecoderLayer):
    """Layers 1..: a Llama decoder layer over the hidden stream; token embeddings enter layer 0 only."""

    def __init__(self, c: LlamaConfig):
        super().__init__(c, c.hidden_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """(residual, attention input), as Eagle3DecoderLayer.attention_input; `embeds` is not read."""
        return hidden, self.input_layernorm(hidden)


class PEagleDrafter(MaskEmbedding, ParallelDrafter):
    family = "peagle"
    config_class = PEagleConfig
    export_formats = ("speculators",)

    def __init__(self, cfg: PEagleConfig, layer_cfg: LlamaConfig, layer_ids: list[int], target_hidden_size: int):
        super().__init__()
        H, N = self.add_target_parts(cfg, layer_cfg, layer_ids)
        n_aux = len(layer_ids) * target_hidden_size
        self.add_mask_embedding(H)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, n_aux))  # the features depths >= 1 read
        self.fc = nn.Linear(n_aux, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(layer_cfg, cfg.norm_before_residual)]
                                    + [PEagleDecoderLayer(layer_cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(H, layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)
        self.rotary_table = RotaryTable(layer_cfg)  # serving-time cos/sin

    @classmethod
    def from_target(cls, cfg: PEagleConfig, target: FrozenTarget, token_counts: torch.Tensor) -> "PEagleDrafter":
        """A drafter for `target`: its embeddings (frozen; the mask token's row starts as the target's),
        its lm_head rows of the draft vocab as a start."""
        return cls.with_mask_token_from_target(cfg, target, token_counts)

    @classmethod
    def from_speculators_config(cls, config: dict, layer_cfg: LlamaConfig) -> "PEagleDrafter":
        """An empty drafter shaped by an export's config.json (speculators.export reads the weights)."""
        cfg = PEagleConfig(depth=speculators_depth(config), num_layers=layer_cfg.num_hidden_layers,
                           draft_vocab_size=config["draft_vocab_size"], keep_ratio=config["down_sample_ratio"],
                           min_keep=config["down_sample_ratio_min"],
                           norm_before_residual=config["norm_before_residual"], mask_token_id=config["mask_token_id"])
        return cls(cfg, layer_cfg, config["eagle_aux_hidden_state_layer_ids"], config["target_hidden_size"])

    def speculators_extra_config(self) -> dict:
        """vLLM reads mask_token_id (its P-EAGLE config maps it to the proposer's mask token); the
        drop-token ratios, under speculators' names, record how the drafter was trained."""
        return eagle3_layout_keys(self) | {"mask_token_id": self.cfg.mask_token_id,
                                               "down_sample_ratio": self.cfg.keep_ratio,
                                               "down_sample_ratio_min": self.cfg.min_keep}

    @property
    def target_hidden_size(self) -> int:
        return self.fc.in_features // len(self.layer_ids)

    def features(self, target_out: TargetOutput) -> torch.Tensor:
        """Hidden inputs of verified positions: the fused low/mid/high target features."""
        return self.fc(torch.cat(target_out.aux_hidden, dim=-1))

    def mask_feature(self) -> torch.Tensor:
        """[1, 1, H]: the hidden input of every depth >= 1, fused through fc like real features."""
        return self.fc(self.mask_hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # --- training ---------------------------------------------------------------------------------

    def kept_rows(self, batch: int, length: int, device=None) -> torch.Tensor:
        """keep [K, B, T] bool: which (depth, anchor) rows a training step computes (module doc).
        Every row in eval mode; COD sampling from the global RNG in training."""
        K = self.depth
        if not self.training:
            return torch.ones(K, batch, length, dtype=torch.bool, device=device)
        u = torch.rand(batch, length, device=device)
        p = torch.tensor([self.cfg.keep_probability(d) for d in range(K)], device=device)
        return u[None] < p[:, None, None]

    def parallel_forward(self, target_out: TargetOutput, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [P, N] of the kept rows (keep [K, B, T], depth 0 all kept), ordered
        by depth, then batch row, then anchor: row (d, b, t) drafts token t+2+d of row b."""
        depth, _, anchor = keep.nonzero(as_tuple=True)
        deeper = len(depth) - keep[0].numel()  # depth 0 comes first, every anchor in (b, t) order
        tokens = torch.cat([shift_left(input_ids, 1).flatten(),
                            input_ids.new_full((deeper,), self.cfg.mask_token_id)])
        hidden = torch.cat([self.features(target_out).flatten(0, 1), self.mask_feature()[0].expand(deeper, -1)])
        cos, sin = self.rotary_table.at(anchor + depth)
        embeds, hidden = self.embed(tokens)[None], hidden[None]
        for layer in self.layers:
            residual, x = layer.attention_input(embeds, hidden)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            hidden = layer.finish(residual, chain_attention(q, k, v, keep))
        return self.logits(hidden[0])

    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """Sum over depths of the soft cross-entropy to the target's renormalised draft-vocab
        distribution (module doc); metrics loss_step{d} and acc_step{d} (draft argmax == target
        argmax over the kept rows whose drafted token is loss-masked) for every depth."""
        B, T = input_ids.shape
        keep = self.kept_rows(B, T, input_ids.device)
        logits = self.parallel_forward(target_out, input_ids, keep)
        depth, row, anchor = keep.nonzero(as_tuple=True)
        learned = (anchor + 1 + depth).clamp(max=T - 1)  # the target position whose distribution row learns
        counted = (anchor + 2 + depth < T) & loss_mask[row, (learned + 1).clamp(max=T - 1)].bool()
        target_argmax = target_out.argmax()[row, learned]
        trained = counted & self.t2d[target_argmax]
        # Restricted to the draft vocab before gathering rows, so no [P, V] copy is made.
        target_logits = target_out.logits_at(self.draft_to_target)[row, learned]
        per_position = distill_loss(logits, target_logits, torch.arange(logits.shape[-1], device=logits.device), trained,
                                    kind=self.cfg.loss)
        hits = (self.draft_to_target[logits.argmax(-1)] == target_argmax) & counted
        loss, metrics = 0.0, {}
        for d in range(self.depth):
            at_depth = depth == d
            step_loss = (per_position * (trained & at_depth)).sum() / (trained & at_depth).sum().clamp(min=1)
            loss = loss + step_loss
            metrics[f"loss_step{d}"] = step_loss.detach()
            metrics[f"acc_step{d}"] = (hits & at_depth).sum() / (counted & at_depth).sum().clamp(min=1)
        return loss, metrics

    # --- serving ----------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int, device=None) -> LayerCaches:
        return LayerCaches.of(self.layer_cfg, len(self.layers), batch, max_len, device)

    @torch.no_grad()
    def draft(self, cache: LayerCaches, tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Append m verified positions (tokens [1, m], `features` [1, m, H]) to the caches and draft
        k tokens in the same pass: draft-vocab logits [k, N] of the last verified position and of
        k-1 mask positions after it, which are cropped from the caches afterwards."""
        start, m, masks = cache.length, tokens.shape[1], k - 1
        tokens = torch.cat([tokens, tokens.new_full((1, masks), self.cfg.mask_token_id)], dim=1)
        hidden = torch.cat([hidden, self.mask_feature().expand(1, masks, -1)], dim=1)
        end = start + m + masks
        cos, sin = (table[start:end] for table in self.rotary_table(end, tokens.device))
        positions = torch.arange(end, device=tokens.device)
        causal = positions[None, :] <= positions[start:, None]
        embeds = self.embed(tokens)
        for layer, layer_cache in zip(self.layers, cache):
            residual, x = layer.attention_input(embeds, hidden)
            q, new_keys, new_values = layer.self_attn.qkv(x, cos, sin)
            keys, values = layer_cache.append(new_keys, new_values)
            hidden = layer.finish(residual, F.scaled_dot_product_attention(q, keys, values, attn_mask=causal))
        cache.crop(start + m)
        return self.logits(hidden[0, m - 1:])


def chain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Attention of the kept rows q, k, v [1, heads, P, d] (ordered as parallel_forward orders
    them) under P-EAGLE's rule, by ttt_attention over dense per-depth [B, heads, T, d] tensors
    into which the rows are scattered. Dropped rows stay zero and are never read: the chain of
    a kept row is kept."""
    counts = keep.flatten(1).sum(1).tolist()
    dense = [[scatter(part, mask) for part, mask in zip(x[0].split(counts, dim=1), keep)] for x in (q, k, v)]
    out = [gather(ttt_attention(dense[0][d], dense[1][: d + 1], dense[2][: d + 1]), keep[d]) for d in range(len(keep))]
    return torch.cat(out, dim=1)[None]


def scatter(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rows [heads, n, d] -> [B, heads, T, d], zeros where mask [B, T] is false."""
    heads, _, d = rows.shape
    dense = rows.new_zeros(*mask.shape, heads, d)
    dense[mask] = rows.transpose(0, 1)
    return dense.transpose(1, 2)


def gather(dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, d] -> the rows where mask [B, T] is true, [heads, n, d]."""
    return dense.transpose(1, 2)[mask].transpose(0, 1)
