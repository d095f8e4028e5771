"""DSpark (DeepSeek 2026, arXiv:2607.05147; deepseek-ai/DeepSpec): DFlash's block drafter with a Markov head
and a confidence head. Model, training and config.

The backbone is DFlash's (speculators/dflash.py): one pass over [anchor, MASK x (B-1)] at positions a..a+B-1,
the target's fused features as extra keys and values. As in DeepSpec and vLLM's speculators
(`sample_from_anchor`), every slot drafts, the anchor's too: slot k drafts the token at a+k+1, so one pass
proposes B tokens.

- Markov head: slot k's logits get a low-rank bias from the token before it (the anchor for slot 0, the
  draft of slot k-1 otherwise), bias = W2(W1[x]) with W1 over the target's vocabulary and W2 into the draft
  vocabulary, rank `markov_rank`. `gated` scales W1[x] by a gate of the slot's hidden state; `rnn` carries a
  GRU-like state over the block. Training feeds the true previous tokens; serving decodes the slots left to
  right through the bias only (the backbone pass is shared), so the draft is semi-autoregressive.
- Confidence head: Linear([hidden, W1[x]] -> 1) per slot, the logit that the target accepts that slot's
  draft given the drafts before it were accepted. Trained with BCE, weight `confidence_alpha`, against
  1 - TV(q, p) over the draft vocabulary (`confidence_target: soft`, the rejection-sampling acceptance rate,
  as speculators trains it) or against draft argmax == target argmax (`hard`, greedy acceptance). The engine
  reads it to decide how many drafts to verify (inference/planning.py).

Weights are named as speculators 0.9.0 names them (markov_head.markov_w1, markov_w2, gate_proj, joint_proj;
confidence_head.proj), so its config and state dict load there and llama.cpp's converter reads the export.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.config import UserError, at_least, one_of, require
from speculators.dflash import DFlashConfig, DFlashDrafter
from speculators.target import TargetOutput

MARKOV_KINDS = ("vanilla", "gated", "rnn")


@dataclass
class DSparkConfig(DFlashConfig):
    family: str = "dspark"
    block_size: int = 8  # B: one pass drafts B tokens (the anchor's slot drafts too)
    markov_rank: int = 256  # r of W1 [V, r] and W2 [r, N]
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_alpha: float = 1.0  # weight of the confidence head's BCE
    confidence_target: str = "soft"  # soft: 1 - TV(q, p) (sampling acceptance); hard: argmax match (greedy)
    confidence_with_markov: bool = True  # the confidence head reads W1[previous token] beside the hidden state

    def __post_init__(self):
        super().__post_init__()
        at_least(1, drafter__markov_rank=self.markov_rank)
        one_of("drafter.markov_head_type", self.markov_head_type, MARKOV_KINDS)
        require(self.confidence_alpha >= 0, "drafter.confidence_alpha", self.confidence_alpha, ">= 0")
        one_of("drafter.confidence_target", self.confidence_target, ("soft", "hard"))

    @property
    def depth(self) -> int:
        return self.block_size


class MarkovHead(nn.Module):
    """The low-rank logit bias from the previous token of the block (see the module doc)."""

    def __init__(self, kind: str, target_vocab: int, draft_vocab: int, rank: int, hidden_size: int):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # starts as no bias: DFlash's drafts
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [gate; candidate; output]

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """(bias [..., N], next state) of one slot: prev_emb = W1[previous token] [..., r], hidden [..., H]."""
        if self.kind == "vanilla":
            return self.markov_w2(prev_emb), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], -1)))
            return self.markov_w2(gate * prev_emb), state
        state = prev_emb.new_zeros(prev_emb.shape) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat([state, prev_emb, hidden], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return self.markov_w2(torch.tanh(output)), gate * state + (1 - gate) * torch.tanh(candidate)

    def block_bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[..., S, N]: every slot's bias from the true previous tokens, prev_emb [..., S, r], hidden [..., S, H]."""
        if self.kind != "rnn":
            return self.step(prev_emb, hidden, None)[0]
        biases, state = [], None
        for k in range(prev_emb.shape[-2]):
            bias, state = self.step(prev_emb[..., k, :], hidden[..., k, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    family = "dspark"
    config_class = DSparkConfig
    export_formats = ("speculators",)
    drafting_kind = "block"  # inference.drafting.BlockProposer: slots decoded left to right through the bias
    first_slot = 0

    def __init__(self, cfg: DSparkConfig, layer_cfg, layer_ids: list[int], target_hidden_size: int):
        super().__init__(cfg, layer_cfg, layer_ids, target_hidden_size)
        H, N = layer_cfg.hidden_size, cfg.draft_vocab_size
        self.markov_head = MarkovHead(cfg.markov_head_type, layer_cfg.vocab_size, N, cfg.markov_rank, H)
        self.confidence_head = ConfidenceHead(H + (cfg.markov_rank if cfg.confidence_with_markov else 0))

    @classmethod
    def from_speculators_config(cls, config: dict, layer_cfg) -> "DSparkDrafter":
        missing = [key for key in ("markov_rank", "enable_confidence_head") if not config.get(key)]
        if missing:
            raise UserError(f"this DSpark export has no {' and no '.join(missing)}: it was trained without the "
                            f"heads this engine serves DSpark with; serve it as DFlash or retrain with them")
        if not config.get("sample_from_anchor", True):
            raise UserError("this DSpark export has sample_from_anchor=false (its anchor slot does not draft); "
                            "only DeepSpec's convention, sample_from_anchor=true, is served here")
        cfg = DSparkConfig(block_size=config["block_size"], num_layers=layer_cfg.num_hidden_layers,
                           draft_vocab_size=config["draft_vocab_size"], mask_token_id=config["mask_token_id"],
                           markov_rank=config["markov_rank"], markov_head_type=config.get("markov_head_type", "vanilla"),
                           confidence_with_markov=config.get("confidence_head_with_markov", True))
        return cls(cfg, layer_cfg, config["aux_hidden_state_layer_ids"], config["target_hidden_size"])

    def speculators_extra_config(self) -> dict:
        """speculators 0.9.0's DSparkSpeculatorConfig keys (DFlash's plus the heads')."""
        return super().speculators_extra_config() | {
            "architectures": ["DSparkSpeculator"], "sample_from_anchor": True,
            "markov_rank": self.cfg.markov_rank, "markov_head_type": self.cfg.markov_head_type,
            "enable_confidence_head": True, "confidence_head_with_markov": self.cfg.confidence_with_markov,
            "confidence_head_alpha": self.cfg.confidence_alpha, "num_anchors": self.cfg.anchors}

    # --- the heads -------------------------------------------------------------------------------

    def confidence(self, normed: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """The confidence logit of slots with final-normed hidden states `normed` [..., H]."""
        features = torch.cat([normed, prev_emb], -1) if self.cfg.confidence_with_markov else normed
        return self.confidence_head(features)

    # --- training ---------------------------------------------------------------------------------

    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """DFlash's weighted distillation loss over slots 0..B-1 on the Markov-biased logits (previous tokens
        teacher-forced), plus confidence_alpha x the confidence head's BCE, weighted the same way. Metrics: DFlash's,
        conf_step{j} (mean predicted acceptance), accept_step{j} (its target), conf_loss."""
        hidden, at, counted, batch, target_argmax = self.block_targets(target_out, input_ids, loss_mask)
        normed = self.norm(hidden)
        prev_emb = self.markov_head.markov_w1(input_ids[batch, at - 1])  # the token before each drafted one
        logits = self.lm_head(normed) + self.markov_head.block_bias(prev_emb, normed)
        rows = counted.nonzero(as_tuple=True)
        logits, argmax, slot = logits[rows], target_argmax[rows], rows[2]
        target_logits = target_out.logits_at(self.draft_to_target)[batch[rows], at[rows] - 1]
        loss, metrics = self.slot_losses(logits, target_logits, self.t2d[argmax], argmax, slot)
        confidence = self.confidence(normed, prev_emb)[rows]
        accepted = self.acceptance_target(logits.detach(), target_logits.detach(), argmax)
        bce = F.binary_cross_entropy_with_logits(confidence, accepted, reduction="none")
        weights = torch.tensor([self.cfg.slot_weight(j + 1) for j in range(self.depth)], device=bce.device)[slot]
        conf_loss = (bce * weights).sum() / weights.sum().clamp(min=1e-6)
        for j in range(self.depth):
            here = slot == j
            metrics[f"conf_step{j}"] = (torch.sigmoid(confidence.detach()) * here).sum() / here.sum().clamp(min=1)
            metrics[f"accept_step{j}"] = (accepted * here).sum() / here.sum().clamp(min=1)
        metrics["conf_loss"] = conf_loss.detach()
        return loss + self.cfg.confidence_alpha * conf_loss, metrics

    def acceptance_target(self, logits: torch.Tensor, target_logits: torch.Tensor, argmax: torch.Tensor):
        """What the confidence head learns per row: sum_v min(q_v, p_v) over the draft vocabulary, or whether
        the draft's argmax is the target's."""
        if self.cfg.confidence_target == "hard":
            return (self.draft_to_target[logits.argmax(-1)] == argmax).float()
        return torch.minimum(torch.softmax(logits.float(), -1), torch.softmax(target_logits.float(), -1)).sum(-1)

    # --- serving ----------------------------------------------------------------------------------

    @torch.no_grad()
    def draft_block(self, cache, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's final-normed hidden states [S, H] after appending the verified positions (block_hidden);
        `slot` turns them into drafts one at a time."""
        return self.norm(self.block_hidden(cache, tokens, hidden))

    @torch.no_grad()
    def slot_confidence(self, normed: torch.Tensor, prev_token: int) -> float:
        """The confidence logit of one slot, normed [H], given the token before it (its logits not needed)."""
        return float(self.confidence(normed, self.markov_head.markov_w1.weight[prev_token]))

    @torch.no_grad()
    def slot(self, normed: torch.Tensor, prev_token: int, state):
        """(draft-vocab logits [N], next Markov state) of one slot, normed [H], given the token before it."""
        bias, state = self.markov_head.step(self.markov_head.markov_w1.weight[prev_token], normed, state)
        return self.lm_head(normed) + bias, state
