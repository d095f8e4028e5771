"""The learned mask-token embedding of the parallel drafters, P-EAGLE (speculators/peagle.py) and DFlash
(speculators/dflash.py): the input of every position whose token is not known yet.

Only row mask_token_id of the target's embeddings learns (`mask_embedding`, H values instead of an
optimizer state over V x H). It starts as the target's row. The state dict folds it into a copy of
embed_tokens.weight, so an export carries it where vLLM reads it (the drafter's embed_tokens), and
loading reads it back from that row. Every occurrence of mask_token_id gets it, so pick an id the data
does not use: by default the least frequent token of the training data.
"""

from dataclasses import replace

import torch
from torch import nn

from common.config import require
from speculators.layers import layer_config


class MaskEmbedding:
    """Mixin for a drafter (an nn.Module) with `embed_tokens` and `cfg.mask_token_id`."""

    def add_mask_embedding(self, hidden_size: int) -> None:
        V = self.embed_tokens.num_embeddings
        require(self.cfg.mask_token_id is not None and 0 <= self.cfg.mask_token_id < V, "drafter.mask_token_id",
                self.cfg.mask_token_id, f"a token id in 0..{V - 1} (the target's vocabulary)")
        self.mask_embedding = nn.Parameter(torch.zeros(hidden_size))  # row mask_token_id of embed_tokens, learned
        self.register_state_dict_post_hook(fold_mask_embedding)
        self.register_load_state_dict_pre_hook(unfold_mask_embedding)

    @torch.no_grad()
    def reset_mask_embedding(self) -> None:
        """Start from the mask token's row of embed_tokens (the target's)."""
        self.mask_embedding.copy_(self.embed_tokens.weight[self.cfg.mask_token_id])

    @classmethod
    def with_mask_token_from_target(cls, cfg, target, token_counts: torch.Tensor):
        """A drafter of `cls` (its __init__ takes cfg, layer_cfg, layer_ids, target_hidden_size) for
        `target`, started as speculators.drafter.Drafter.start_from_target, its mask row the target's."""
        cfg = with_mask_token(cfg, token_counts)
        layer_cfg = layer_config(target)
        layer_cfg.num_hidden_layers = cfg.num_layers
        drafter = cls(cfg, layer_cfg, target.layer_ids, target.hidden_size)
        drafter.start_from_target(target, token_counts, cfg.draft_vocab_size)
        drafter.reset_mask_embedding()
        return drafter

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embeddings, with the learned mask embedding wherever mask_token_id stands."""
        is_mask = (tokens == self.cfg.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding, self.embed_tokens(tokens))


def with_mask_token(cfg, token_counts: torch.Tensor):
    """`cfg` with its mask_token_id, by default the least frequent id of the training data."""
    return cfg if cfg.mask_token_id is not None else replace(cfg, mask_token_id=least_frequent(token_counts))


def least_frequent(token_counts: torch.Tensor) -> int:
    """The least frequent id of the training data, the highest among ties."""
    return len(token_counts) - 1 - int(torch.argmin(token_counts.flip(0)))


def fold_mask_embedding(module: MaskEmbedding, state_dict: dict, prefix: str, _metadata) -> None:
    """state_dict() post-hook: write the learned mask embedding into a copy of embed_tokens.weight."""
    table = state_dict[prefix + "embed_tokens.weight"].detach().clone()
    table[module.cfg.mask_token_id] = state_dict.pop(prefix + "mask_embedding").detach()
    state_dict[prefix + "embed_tokens.weight"] = table


def unfold_mask_embedding(module: MaskEmbedding, state_dict: dict, prefix: str, *_) -> None:
    """load_state_dict() pre-hook: read the mask embedding back from its row."""
    table = state_dict.get(prefix + "embed_tokens.weight")
    if table is not None:
        state_dict[prefix + "mask_embedding"] = table[module.cfg.mask_token_id]
