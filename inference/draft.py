"""A proposal the target verifies in one pass (`Draft`: nodes with target-vocab tokens and parent links), and
the helpers every proposer shares: q over the target vocabulary, seeded sampling, a planner's prefix."""

from dataclasses import dataclass

import torch

from inference.planning import logit


@dataclass
class Draft:
    tokens: list[int]  # target-vocab ids, parents before children
    parents: list[int]  # index of each node's parent in `tokens`; -1 = the root
    probs: torch.Tensor | None = None  # [n, V] draft distribution q per node (chain sampling only)
    looked_up: bool = False  # an n-gram lookup's chain (LookupProposer), not the drafter's
    estimates: list[float] | None = None  # per chain node: the calibrated chance it is accepted if its parent is

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None, looked_up: bool = False,
              estimates: list[float] | None = None) -> "Draft":
        return cls(tokens, list(range(-1, len(tokens) - 1)), probs, looked_up, estimates)

    def prefix(self, n: int) -> "Draft":
        """The chain's first n drafts."""
        return Draft.chain(self.tokens[:n], None if self.probs is None else self.probs[:n], self.looked_up,
                           None if self.estimates is None else self.estimates[:n])

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Depth of each node: 1 for the root's children."""
        depth = []
        for parent in self.parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    def tree_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool over [root, *nodes]: row i sees itself and its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i + 1] |= mask[parent + 1]
        return mask


def draft_distribution(to_target: torch.Tensor, vocab_size: int, draft_logits: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """q over the target vocabulary: the drafter's tempered softmax, zero outside the draft vocab."""
    q = torch.zeros(vocab_size, device=draft_logits.device)
    q[to_target] = torch.softmax(draft_logits / temperature, -1)
    return q


def sample(q: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of q from the seeded CPU generator, wherever q lives."""
    return torch.multinomial(q.cpu(), 1, generator=generator)


def planned(planner, draft: Draft, top: torch.Tensor) -> Draft:
    """The prefix of a chain whose drafts were made at once that the planner verifies (at least one draft), from
    the drafter's top probability per draft, `top` [n]."""
    if planner is None:
        return draft
    estimates = [planner.calibrated(i + 1, logit(float(p))) for i, p in enumerate(top)]
    kept = max(planner.best_length(estimates), 1)
    return Draft.chain(draft.tokens, draft.probs, draft.looked_up, estimates).prefix(kept)


def point_masses(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """[n, V]: q of a draft that is certain of each token."""
    q = torch.zeros(len(tokens), vocab_size)
    q[torch.arange(len(tokens)), tokens] = 1.0
    return q
