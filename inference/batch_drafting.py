"""Batch proposers: how a drafter proposes chains for a batch of prompts (engine.generate_batch).

A batch drafts chains only, through a BatchProposer (BATCH_PROPOSERS, by drafting_kind): `accept(inputs [B, m], target_out, counts [B])` (the prefill too: the
left-padded prompts shifted by one, then the first token; row r's tokens are its first
counts[r], the rest are holes), `propose(temperature, generator) -> (tokens [B, k], q [B, k, V]
or None)`, and `select(index)` to keep the rows still decoding. The drafter's cache slots are
the target session's (inference.sessions.BatchSlots): the same positions, pads and holes.
"""

import torch

from common.config import UserError
from inference.draft import sample
from inference.drafting import DraftingConfig, MedusaChainProposer
from inference.sessions import BatchSlots
from speculators.target import TargetOutput


class BatchChainProposer:
    """ChainProposer for a batch: every row drafts k tokens, one drafter step per draft for all rows
    at once. Same cache indexing: slot s holds (token s+1, features of s)."""

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, slots: BatchSlots, device=None):
        self.drafter, self.k, self.vocab_size, self.slots = drafter, k, vocab_size, slots
        self.to_target = drafter.draft_to_target
        self.cache = drafter.new_cache(len(slots), max_len, device)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor):
        """drafter.step at each row's own positions, pads and holes hidden."""
        start, end = self.cache.length, self.cache.length + tokens.shape[1]
        return self.drafter.step(self.cache, tokens, hidden, positions=self.slots.positions(start, end)[:, None],
                                 visible=self.slots.visible(start, end))

    def accept(self, inputs: torch.Tensor, target_out: TargetOutput, counts: torch.Tensor) -> None:
        logits, hidden = self.step(inputs, self.drafter.features(target_out))
        rows, last = torch.arange(len(counts), device=counts.device), counts - 1  # each row drafts from its last token
        self.logits, self.hidden = logits[rows, last][:, None], hidden[rows, last][:, None]

    def propose(self, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        verified, tokens, probs = self.cache.length, [], []
        logits, hidden = self.logits, self.hidden
        for i in range(self.k):
            if i:
                logits, hidden = self.step(tokens[-1][:, None], hidden)
            if temperature == 0:
                tokens.append(self.to_target[logits[:, -1].argmax(-1)])
            else:
                q = logits.new_zeros(len(logits), self.vocab_size)
                q[:, self.to_target] = torch.softmax(logits[:, -1] / temperature, -1)  # q in the target vocabulary
                tokens.append(sample(q, generator)[:, 0].to(q.device))
                probs.append(q)
        self.cache.crop(verified)
        return torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows `index`; the caller selects the slots."""
        self.cache.k, self.cache.v = self.cache.k[index], self.cache.v[index]


class BatchMedusaChainProposer(MedusaChainProposer):
    """MedusaChainProposer for a batch: no drafter cache, each row's heads read its last position."""

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, slots: BatchSlots, device=None):
        super().__init__(drafter, k, vocab_size, max_len, DraftingConfig(), device)

    def accept(self, inputs: torch.Tensor, target_out: TargetOutput, counts: torch.Tensor) -> None:
        last = target_out.last_hidden[torch.arange(len(counts), device=counts.device), counts - 1]
        self.logits = self.drafter.head_logits(last, range(self.k))  # [B, k, V]

    def propose(self, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        if temperature == 0:
            return self.logits.argmax(-1), None
        q = torch.softmax(self.logits / temperature, -1)
        return sample(q.flatten(0, 1), generator).view(q.shape[:2]).to(q.device), q

    def select(self, index: torch.Tensor) -> None:
        pass  # accept() replaces the only state


BATCH_PROPOSERS = {"autoregressive": BatchChainProposer, "heads": BatchMedusaChainProposer}


def make_batch_proposer(drafter, k: int, vocab_size: int, max_len: int, slots: BatchSlots, device=None):
    kind = drafter.drafting_kind
    if kind not in BATCH_PROPOSERS:
        raise UserError(f"batches of prompts are not served for a {type(drafter).__name__} yet; use batch_size=1")
    return BATCH_PROPOSERS[kind](drafter, k, vocab_size, max_len, slots, device)
