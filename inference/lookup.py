"""N-gram lookup in front of a drafter's proposer (drafting.prompt_lookup_max)."""

import torch

from inference.draft import Draft, point_masses
from speculators.target import TargetOutput


class LookupProposer:
    """N-gram lookup in front of a drafter (prompt lookup, Saxena 2023; vLLM's ngram; the suffix
    matching of SuffixDecoding and Arctic Inference's hybrid): when the last n tokens of the
    context (prompt and emitted tokens), n from prompt_lookup_max down to prompt_lookup_min,
    occurred before, the chain is the up to prompt_lookup_tokens (default K) tokens that followed
    their latest occurrence;
    otherwise the drafter proposes. Small targets loop and quote their prompt, where a lookup is
    right more often than the drafter and costs no drafter pass. The drafter still reads every
    accepted position, so its cache stays whole. A lookup draft is a point mass: q(x) = 1, so
    rejection sampling accepts it with probability p(x) and stays lossless."""

    def __init__(self, drafter_proposer, k: int, vocab_size: int, drafting):  # drafting: a DraftingConfig
        self.inner, self.vocab_size = drafter_proposer, vocab_size
        self.length = drafting.lookup_length(k)
        self.sizes = range(drafting.prompt_lookup_max, drafting.prompt_lookup_min - 1, -1)
        self.context: list[int] = []
        self.last_seen: dict[tuple, int] = {}  # n-gram -> where the token after its latest occurrence is
        self.reached = [0] * self.length  # lookup drafts verified with their position i's parent accepted
        self.survived = [0] * self.length  # ... and position i accepted too
        self.looked_up: list[int] | None = None  # the lookup chain being verified

    @property
    def planner(self):
        return getattr(self.inner, "planner", None)

    @planner.setter
    def planner(self, planner) -> None:
        self.inner.planner = planner

    def prefill(self, prompt: list[int], token: int, target_out: TargetOutput) -> None:
        self.extend(prompt + [token])
        self.inner.prefill(prompt, token, target_out)

    def accept(self, new_tokens: list[int], target_out: TargetOutput) -> None:
        if self.looked_up is not None:
            accepted = len(new_tokens) - 1
            for i in range(min(accepted + 1, len(self.looked_up))):
                self.reached[i] += 1
                self.survived[i] += i < accepted
            self.looked_up = None
        self.extend(new_tokens)
        self.inner.accept(new_tokens, target_out)

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a token after them (the context's own suffix stays out)."""
        start = len(self.context)
        self.context += tokens
        for end in range(max(start, 1), len(self.context)):
            for n in self.sizes:
                if end >= n:
                    self.last_seen[tuple(self.context[end - n : end])] = end

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        for n in self.sizes:
            after = self.last_seen.get(tuple(self.context[-n:]))
            if after is not None:
                tokens = self.context[after : after + self.length]
                draft = Draft.chain(tokens, point_masses(tokens, self.vocab_size) if temperature else None, True)
                if self.planner:  # lookup's own rates, calibrated by counting; its drafts cost no drafter time
                    estimates = self.survival_rates(len(tokens))
                    kept = max(self.planner.best_length(estimates, looked_up=True), 1)
                    draft = Draft.chain(draft.tokens, draft.probs, True, estimates).prefix(kept)
                self.looked_up = draft.tokens
                return draft
        return self.inner.propose(temperature, generator)

    def survival_rates(self, n: int) -> list[float]:
        """Lookup's own estimate per position: how often a lookup draft there survived with its parent accepted,
        smoothed by two pseudo-drafts at the estimate of the position before (1/2 for the first). A chain that
        quotes earlier text tends to go on, so a position a plan has not verified yet starts where the one before
        it stands, not at 1/2, which would keep the plan from ever verifying (and so counting) it."""
        rates, prior = [], 0.5
        for i in range(n):
            prior = (self.survived[i] + 2 * prior) / (self.reached[i] + 2)
            rates.append(prior)
        return rates
