"""The reduced draft vocabulary and its two maps, as vLLM and SGLang read them.

Keep the N most frequent target tokens of the training data (loss-masked tokens only),
sorted by id. d2t[i] = target_id(i) - i (int64 [N]), so target_id = i + d2t[i];
t2d is a bool mask over the target vocabulary. A missing or wrong d2t loads fine in a
serving engine and then accepts almost nothing, so every export and load checks them.
"""

import torch

from common.config import UserError


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Frequency of each target token among the positions the loss trains on."""
    return torch.bincount(input_ids[loss_mask.bool()].flatten(), minlength=vocab_size)[:vocab_size]


def build(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `size` most frequent tokens; ties go to the lower id."""
    vocab_size = len(counts)
    if not 0 < size <= vocab_size:
        raise UserError(f"draft_vocab_size={size} must be in 1..{vocab_size} (the target's vocabulary size)")
    kept = torch.argsort(counts, descending=True, stable=True)[:size].sort().values
    d2t = kept - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def check(d2t: torch.Tensor | None, t2d: torch.Tensor | None, target_vocab_size: int, draft_vocab_size: int) -> None:
    """Refuse maps that would silently break acceptance: missing, wrong dtype, length or content."""
    if d2t is None or t2d is None:
        raise UserError("the drafter has no d2t/t2d maps; a reduced-vocab drafter cannot be served without them")
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise UserError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if len(d2t) != draft_vocab_size or len(t2d) != target_vocab_size:
        raise UserError(f"d2t has {len(d2t)} entries (draft vocab {draft_vocab_size}) and t2d {len(t2d)} "
                        f"(target vocab {target_vocab_size})")
    ids = target_ids(d2t)
    if ids.min() < 0 or ids.max() >= target_vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise UserError("d2t does not map draft ids to increasing target ids inside the target vocabulary")
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[ids].all()):
        raise UserError("t2d does not mark exactly the target ids that d2t maps to")
