"""Medusa-1 (Cai et al. 2024, arXiv:2401.10774): K decoding heads on the frozen target's last
hidden state, their loss and config.

h_t is the target's hidden_states[L] at position t, after the final norm: the input of its
lm_head (TargetOutput.last_hidden), which predicts token t+1. Head k = 1..K predicts token t+k+1:

    head_k(h) = W_k ResBlock_{k,n}(... ResBlock_{k,1}(h))      ResBlock(x) = x + SiLU(A x + b)

A and b start at zero, so a fresh block is the identity, and W_k [V, H] starts as a copy of the
target's lm_head: a fresh head predicts what the target predicts for the next token and learns
from there. (Medusa zeroes only A; b keeps PyTorch's default init, so its heads start near the
lm_head, not at it.) Medusa-1: the target is frozen and only the heads train.

Loss, distilled from the target rather than from the data's tokens:

    loss = sum_k head_decay^k * mean_t CE_k(t),  CE_k(t) = -sum_v p_{t+k}(v) log softmax(head_k(h_t))_v

p_{t+k} = softmax(target logits at t+k) is the target's distribution of token t+k+1, the one
head k drafts at t; position t counts when token t+k+1 is loss-masked (as eagle3.py counts).
head_decay = 0.8 is Medusa's (its head k weighs 0.8^k). `loss: kl` uses KL(p || q) instead:
the same gradient; the logged value drops p's entropy, so a perfect head shows 0. `lk`, `lk_hybrid`:
the acceptance losses of kernels/distill.py.

The vocabulary is the target's, whole: d2t is zeros, t2d all true, draft id = target id.

Serving (drafting_kind "heads", inference.drafting): at the last verified position, whose next
token is the bonus token just emitted, head i ranks the candidates for draft i. A chain takes
each head's argmax. A tree takes `tree_choices`: path [r_1, ..., r_d] is the node whose token is
head d's r_d-th best (0 = the argmax), child of node [r_1, ..., r_{d-1}]. Medusa builds its trees
greedily, adding at each step the node whose path is likeliest to be accepted (from each head's
top-r accuracy on calibration data), so a path's parent comes first and every prefix of the list
is a tree. The default is the first 16 nodes of Medusa's own tree (medusa_choices.py,
mc_sim_7b_63, estimated for Vicuna-7B): 6 candidates for draft 1, 8 for draft 2, 2 for draft 3.
16 is the number of nodes the engine verifies by default (drafting.tree_total_tokens), and a
target pass over 16 tokens costs about twice one token's on this machine (results/pycode/bench).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from common.config import UserError, at_least, one_of, require
from forge_kernels import distill_loss
from forge_kernels.distill import KINDS
from speculators.drafter import HeadsDrafter
from speculators.layers import shift_left
from speculators.target import FrozenTarget, TargetOutput

# Medusa's mc_sim_7b_63 up to 16 nodes, in its order (likeliest accepted first).
DEFAULT_TREE = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
                [0, 0, 1], [5]]


@dataclass
class MedusaConfig:
    family: str = "medusa"
    depth: int = 5  # K, Medusa's heads: head k drafts the token k positions after the target's next one
    num_layers: int = 1  # ResBlocks per head (Medusa: 1)
    head_decay: float = 0.8  # head k's loss weighs head_decay**k (Medusa: 0.8)
    loss: str = "soft_ce"  # distillation loss (kernels/distill.py): soft_ce | kl (one gradient) | lk | lk_hybrid
    # Paths of per-head ranks (lists of ints), checked by check_tree: OmegaConf's own errors for a
    # list[list[int]] field lose the key's name.
    tree_choices: list = field(default_factory=lambda: [list(path) for path in DEFAULT_TREE])

    def __post_init__(self):
        at_least(1, drafter__depth=self.depth, drafter__num_layers=self.num_layers)
        require(0 < self.head_decay <= 1, "drafter.head_decay", self.head_decay, "in (0, 1]")
        one_of("drafter.loss", self.loss, KINDS)
        check_tree(self.tree_choices)


def check_tree(choices: list[list[int]]) -> None:
    """Paths of per-head ranks, each listed once and after its parent. Paths deeper than the heads
    (or than the drafts asked for) are valid and not drafted, so one tree serves any depth."""
    require(len(choices) > 0, "drafter.tree_choices", choices, "a non-empty list of paths, e.g. [[0], [0, 0], [1]]")
    seen = set()
    for path in choices:
        if not (isinstance(path, list) and path and all(type(rank) is int and rank >= 0 for rank in path)):
            raise UserError(f"drafter.tree_choices: path {path!r} must be a non-empty list of ranks (ints >= 0)")
        path = tuple(path)
        if path in seen:
            raise UserError(f"drafter.tree_choices: path {list(path)} is listed twice")
        if len(path) > 1 and path[:-1] not in seen:
            raise UserError(f"drafter.tree_choices: path {list(path)} comes before its parent {list(path[:-1])}; "
                            f"list every parent before its children")
        seen.add(path)


class ResBlock(nn.Module):
    """x + SiLU(linear(x)), the identity while linear is zero (how it starts)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def medusa_head(hidden_size: int, vocab_size: int, num_layers: int) -> nn.Sequential:
    """ResBlocks then the vocabulary projection; indexed as Medusa's ({layer}.linear.*, {num_layers}.weight)."""
    return nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                         nn.Linear(hidden_size, vocab_size, bias=False))


class MedusaDrafter(HeadsDrafter):
    family = "medusa"
    config_class = MedusaConfig
    export_formats = ("medusa",)
    drafts_beyond_depth = False  # one head per position

    def __init__(self, cfg: MedusaConfig, hidden_size: int, vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.heads = nn.ModuleList(medusa_head(hidden_size, vocab_size, cfg.num_layers)
                                   for _ in range(cfg.depth))
        # The full vocabulary: constants, so not saved (the Medusa format has no maps).
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool), persistent=False)

    @classmethod
    def from_target(cls, cfg: MedusaConfig, target: FrozenTarget, token_counts: torch.Tensor) -> "MedusaDrafter":
        """Heads for `target`, each projection a copy of its lm_head. token_counts is not used:
        Medusa drafts over the whole target vocabulary."""
        drafter = cls(cfg, target.hidden_size, target.vocab_size)
        with torch.no_grad():
            for head in drafter.heads:
                head[-1].weight.copy_(target.lm_head_weight().float())
        return drafter

    @property
    def target_hidden_size(self) -> int:
        return self.lm_head.in_features

    @property
    def lm_head(self) -> nn.Linear:
        """Head 1's vocabulary projection; every head's has this shape (what Drafter.check reads)."""
        return self.heads[0][-1]

    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """Decayed sum over heads of the soft cross-entropy (or KL) to the target's distribution
        (module doc). Metrics per head k = j+1: loss_step{j} and acc_step{j}, the agreement of its
        argmax with the target's argmax for token t+k+1, over the positions that count."""
        hidden, target_logits = target_out.last_hidden, target_out.full_logits()
        target_argmax = target_out.argmax()
        loss, metrics = 0.0, {}
        for j, head in enumerate(self.heads):
            k = j + 1
            counted = shift_left(loss_mask, k + 1).bool()  # head k at t drafts token t+k+1
            logits = head(hidden)
            per_position = distill_loss(logits, target_logits, self.draft_to_target, counted, kind=self.cfg.loss,
                                        shift=k)
            head_loss = per_position.sum() / counted.sum().clamp(min=1)
            loss = loss + self.cfg.head_decay**k * head_loss
            hits = (logits.argmax(-1) == shift_left(target_argmax, k)) & counted
            metrics[f"loss_step{j}"] = head_loss.detach()
            metrics[f"acc_step{j}"] = hits.sum() / counted.sum().clamp(min=1)
        return loss, metrics

    @torch.no_grad()
    def head_logits(self, last_hidden: torch.Tensor, heads: range | None = None) -> torch.Tensor:
        """[B, len(heads), V]: the logits of `heads` (all by default) at one position per row, last_hidden [B, H].
        Each head projects onto the whole vocabulary, so serving computes only the heads it drafts with."""
        return torch.stack([self.heads[i](last_hidden) for i in (range(len(self.heads)) if heads is None else heads)],
                           dim=1)
