"""EAGLE-1 (Li et al. 2024, arXiv:2401.15077): model, loss and config.

Autoregression over features: at position t the drafter reads the next token x_{t+1} and the
target's feature f_t, and predicts the feature f_{t+1}:

    f_hat_t = layer(fc([embed(x_{t+1}); f_t]))      fc: 2H -> H with bias; one Llama decoder
                                                     layer without input_layernorm
    draft logits_t = lm_head(f_hat_t)                the target's lm_head, frozen: predicts x_{t+2}

f is the target's last hidden state hidden_states[L], which is *after* its final norm: the
input of lm_head. EAGLE's code does the same (ea_model.py feeds the draft
`base_model.model(...)[0]`, which transformers returns after the final norm, and cnets1.py
applies the base lm_head to the draft's output with no norm between), so the regression
target and the lm_head input are one space; applying the target's norm again would
normalise twice. The drafter owns no norm of its own after the layer.

Loss at position t, as in EAGLE's train/main.py, counted when token t+2 (the one position t
predicts) is loss-masked, as eagle3.py counts (EAGLE's script counts it by token t's mask):

    regression_weight   * SmoothL1(f_hat_t, f_{t+1})   (mean over the H features)
  + distillation_weight * -sum_v p_{t+1}(v) log softmax(lm_head(f_hat_t))_v,
                          p_{t+1} = softmax(target logits at t+1)

Training adds uniform noise U(-a/2, a/2), a = input_noise, to the input features (not to the
regression target), so the drafter learns to correct the errors its own predicted features
carry when it drafts a chain. EAGLE's train/main.py draws (rand - 0.5) * 0.2 * 512 / T for a
sequence of T tokens: U(-0.1, 0.1) at T = 512, the figure of its paper. We keep a = 0.2 and
leave out the 1/T scaling, which would make short sequences noisier than long ones.

The vocabulary is the target's, whole: d2t is zeros, t2d all true, draft id = target id.
Embeddings and lm_head are copies of the target's and stay frozen.

Serving drafts a chain: each step feeds its f_hat back as the next hidden input with the
drafted token. Validation measures that for every chain position j (acc_step{j}): the
unrolled step j reads token t+1+j and its own f_hat of step j-1 at rotary position t+j and
attends as EAGLE-3's training-time test does (layers.ttt_attention). Training computes only
step 0, the one it trains.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from common.config import at_least, one_of, require
from forge_kernels import distill_loss
from forge_kernels.distill import KINDS
from speculators import layers
from speculators.drafter import ChainDrafter
from speculators.target import FrozenTarget, TargetOutput


@dataclass
class EagleConfig:
    family: str = "eagle"
    depth: int = 5  # chain length served; validation reports acc_step0..K-1
    regression_weight: float = 1.0  # SmoothL1 feature regression (EAGLE: v_w = 1.0)
    distillation_weight: float = 0.1  # soft cross-entropy to the target's next-token distribution (EAGLE: p_w = 0.1)
    input_noise: float = 0.2  # width a of the uniform noise U(-a/2, a/2) on input features in training
    loss: str = "soft_ce"  # its distillation term (kernels/distill.py): soft_ce | kl (one gradient) | lk | lk_hybrid

    def __post_init__(self):
        at_least(1, drafter__depth=self.depth)
        at_least(0, drafter__regression_weight=self.regression_weight,
                 drafter__distillation_weight=self.distillation_weight, drafter__input_noise=self.input_noise)
        require(self.regression_weight + self.distillation_weight > 0, "drafter.distillation_weight",
                self.distillation_weight, "> 0 when drafter.regression_weight is 0 (nothing would be trained)")
        one_of("drafter.loss", self.loss, KINDS)


class EagleDrafter(ChainDrafter):
    family = "eagle"
    config_class = EagleConfig
    export_formats = ("eagle",)

    def __init__(self, cfg: EagleConfig, layer_cfg: LlamaConfig):
        super().__init__()
        self.cfg, self.layer_cfg = cfg, layer_cfg
        H, V = layer_cfg.hidden_size, layer_cfg.vocab_size
        self.embed_tokens = nn.Embedding(V, H).requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(2 * H, H, bias=True)
        # A Llama decoder layer without input_layernorm: EAGLE-1's layer 0 attends over fc's output as is.
        self.layers = nn.ModuleList([layers.LlamaDecoderLayer(layer_cfg, H)])
        self.lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)  # the target's, frozen
        # The full vocabulary: constants, so not saved (the EAGLE format has no maps).
        self.register_buffer("d2t", torch.zeros(V, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool), persistent=False)
        self.rotary_table = layers.RotaryTable(layer_cfg)  # serving-time cos/sin

    @classmethod
    def from_target(cls, cfg: EagleConfig, target: FrozenTarget, token_counts: torch.Tensor) -> "EagleDrafter":
        """A drafter for `target` with copies of its embeddings and lm_head (frozen). token_counts
        is not used: EAGLE-1 drafts over the whole target vocabulary."""
        drafter = cls(cfg, layers.layer_config(target))
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.embedding_weight().float())
            drafter.lm_head.weight.copy_(target.lm_head_weight().float())
        return drafter

    @property
    def target_hidden_size(self) -> int:
        return self.fc.in_features // 2

    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc([embed(tokens); hidden]): the layer's input and its residual."""
        return self.fc(torch.cat([self.embed_tokens(tokens), hidden], dim=-1))

    def unrolled_step(self, j: int, tokens: torch.Tensor, hidden: torch.Tensor, keys: list, values: list):
        """Step j of the teacher-forced unroll over whole sequences: tokens [B, T] (token t+1+j at
        position t), hidden inputs [B, T, H]; appends its keys and values, returns f_hat [B, T, H]."""
        layer, x = self.layers[0], self.fuse(tokens, hidden)
        positions = torch.arange(tokens.shape[1], device=tokens.device) + j
        q, k, v = layer.self_attn.qkv(x, *self.rotary_table.at(positions))
        keys.append(k)
        values.append(v)
        return layer.finish(x, layers.ttt_attention(q, keys, values))

    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """Feature regression plus distillation at step 0 (module docstring); returns (loss,
        metrics) with both parts and the top-1 agreement with the target's argmax per chain step."""
        features = target_out.last_hidden
        if self.training and self.cfg.input_noise:
            features = features + (torch.rand_like(features) - 0.5) * self.cfg.input_noise
        counted = layers.shift_left(loss_mask, 2).bool()  # position t predicts token t+2
        keys, values = [], []
        predicted = self.unrolled_step(0, layers.shift_left(input_ids, 1), features, keys, values)
        logits = self.lm_head(predicted)
        regression = F.smooth_l1_loss(predicted, layers.shift_left(target_out.last_hidden, 1), reduction="none")
        distillation = distill_loss(logits, target_out.full_logits(), self.draft_to_target, counted, kind=self.cfg.loss,
                                    shift=1)
        regression = regression.mean(-1)
        regression, distillation = masked_mean(regression, counted), masked_mean(distillation, counted)
        loss = self.cfg.regression_weight * regression + self.cfg.distillation_weight * distillation
        target_argmax = target_out.argmax()
        metrics = {"loss_regression": regression.detach(), "loss_distillation": distillation.detach(),
                   "acc_step0": accuracy(logits, target_argmax, loss_mask, 0)}
        if not self.training:
            metrics |= self.chain_accuracy(input_ids, loss_mask, target_argmax, predicted, keys, values)
        return loss, metrics

    @torch.no_grad()
    def chain_accuracy(self, input_ids, loss_mask, target_argmax, predicted, keys, values) -> dict:
        """acc_step{j} for j >= 1: step j reads the drafter's own f_hat of step j-1, as a served chain does."""
        metrics = {}
        for j in range(1, self.depth):
            predicted = self.unrolled_step(j, layers.shift_left(input_ids, 1 + j), predicted, keys, values)
            metrics[f"acc_step{j}"] = accuracy(self.lm_head(predicted), target_argmax, loss_mask, j)
        return metrics

    def new_cache(self, batch: int, max_len: int, device=None) -> layers.KVCache:
        return layers.KVCache.of(self.layer_cfg, batch, max_len, device)

    def features(self, target_out: TargetOutput) -> torch.Tensor:
        """Hidden inputs of verified positions: the target's last hidden state (after its final norm)."""
        return target_out.last_hidden

    @torch.no_grad()
    def step(self, cache: layers.KVCache, tokens: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor | None = None, visible: torch.Tensor | None = None):
        """Serve m positions appended after `cache`: tokens [B, m] and hidden inputs [B, m, H],
        which are `features` for verified positions, or the drafter's own f_hat while it drafts.
        Returns logits over the target vocabulary and f_hat [B, m, H]. Positions default to the
        next m and attention to causal; a tree draft passes its nodes' rotary positions and
        `visible` [m, cache.length + m] (context and own ancestors). `cache.crop` undoes it.
        """
        x = self.fuse(tokens, hidden)
        predicted = layers.cached_layer(self.layers[0], self.rotary_table, cache, x, x, positions, visible)
        return self.lm_head(predicted), predicted


def masked_mean(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (per_position * mask).sum() / mask.sum().clamp(min=1)


def accuracy(logits: torch.Tensor, target_argmax: torch.Tensor, loss_mask: torch.Tensor, j: int) -> torch.Tensor:
    """Top-1 agreement of chain step j (logits [B, T, V] at position t predict token t+2+j) with
    the target's argmax at t+1+j, over positions whose token t+2+j is loss-masked. Draft ids
    are target ids (the full vocabulary)."""
    counted = layers.shift_left(loss_mask, 2 + j).bool()
    hits = (logits.argmax(-1) == layers.shift_left(target_argmax, 1 + j)) & counted
    return hits.sum() / counted.sum().clamp(min=1)
