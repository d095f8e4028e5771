"""Speculative decoding in one loop: draft K tokens, verify them in one target pass, accept,
emit the bonus token, roll both KV caches back past the rejected drafts.

Notation (Leviathan et al. 2023; Chen et al. 2023): p = the target's next-token
distribution, q = the drafter's. Greedy verification accepts the longest prefix of drafts
equal to the target's argmax. Sampling accepts draft x ~ q with probability
min(1, p(x)/q(x)) and on rejection samples from norm(max(0, p - q)), so every emitted token
is distributed exactly as the target alone would sample it. Both rules live once, in
kernels.verify (a Triton kernel on GPUs, its torch reference here).

Batch size 1. The target runs in a session (inference.sessions: a preallocated cache for
Llama-family targets, transformers' DynamicCache otherwise); the drafter keeps a
preallocated cache (speculators.layers.KVCache). The drafter interface is two calls:
`fuse(aux_hidden)` -> hidden inputs for verified positions, and `step(cache, tokens, hidden)`
-> (draft-vocab logits, hidden) for positions appended to its cache.
"""

import time
from dataclasses import dataclass, field

import torch

import kernels
from inference.sessions import open_session
from speculators.config import UserError
from speculators.target import FrozenTarget


@dataclass
class Stats:
    """Counters as vLLM defines them; one "draft" is one verification step."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # drafts whose token i was accepted, i = 1..k
    target_forwards: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0  # after the first token; of which:
    draft_s: float = 0.0  # drafter calls (chains, and reading the accepted positions)
    verify_s: float = 0.0  # target passes over the drafts

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += self.k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def add(self, other: "Stats") -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "target_forwards", "ttft_s", "decode_s",
                     "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]


@dataclass
class Generation:
    tokens: list[int]
    stats: Stats


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count, next token): target_logits [k+1, V] from the pass over [last, *drafts]."""
    accepted, token = kernels.verify_greedy(torch.tensor([drafts], dtype=torch.long), target_logits[None])
    return int(accepted), int(token)


def verify_sampling(drafts: list[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    temperature: float, generator: torch.Generator) -> tuple[int, int]:
    """Lossless rejection sampling; draft_probs [k, V] is q in the target vocabulary."""
    uniform = torch.rand(1, len(drafts) + 1, generator=generator)
    accepted, token = kernels.verify_sampling(torch.tensor([drafts], dtype=torch.long), draft_probs[None],
                                              target_logits[None], temperature, uniform)
    return int(accepted), int(token)


def check_pair(target: FrozenTarget, drafter) -> None:
    """Refuse a drafter built for another target before generating anything."""
    hidden = drafter.target_hidden_size
    problems = []
    if hidden != target.hidden_size:
        problems.append(f"hidden size {hidden} (drafter) vs {target.hidden_size} (target)")
    if len(drafter.t2d) != target.vocab_size:
        problems.append(f"vocabulary size {len(drafter.t2d)} (drafter) vs {target.vocab_size} (target)")
    if len(drafter.d2t) != drafter.lm_head.out_features:
        problems.append(f"d2t length {len(drafter.d2t)} vs the drafter's {drafter.lm_head.out_features} draft tokens")
    if max(getattr(drafter, "layer_ids", None) or [0]) >= target.num_layers:
        problems.append(f"feature layer ids {drafter.layer_ids} (drafter) vs a target of {target.num_layers} layers")
    if problems:
        raise UserError("drafter does not fit the target: " + "; ".join(problems))


@torch.no_grad()
def generate(target: FrozenTarget, drafter, prompt: list[int], max_new_tokens: int, k: int = 5,
             temperature: float = 0.0, seed: int = 0) -> Generation:
    """Decode up to max_new_tokens after `prompt`; k=0 (or no drafter) is plain target decoding."""
    limit = target.config.max_position_embeddings
    if len(prompt) + max_new_tokens + k + 1 > limit:
        raise UserError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new + {k} drafts exceeds the "
                        f"target's context of {limit} positions")
    k = k if drafter is not None else 0
    generator = torch.Generator().manual_seed(seed)
    eos = target.tokenizer.eos_token_id
    max_len = len(prompt) + max_new_tokens + k + 1
    stats, session = Stats(k), open_session(target, max_len)
    started = time.perf_counter()
    out = session(torch.tensor([prompt]))
    token = pick(out.logits[0, -1], temperature, generator)
    stats.target_forwards, stats.ttft_s = 1, time.perf_counter() - started
    tokens = [token]
    if k:
        to_target = drafter.draft_to_target  # draft id -> target id, once per generation
        draft_cache = drafter.new_cache(1, max_len)
        draft_logits, hidden = drafter.step(draft_cache, torch.tensor([prompt[1:] + [token]]),
                                            drafter.fuse(out.aux_hidden))
    while len(tokens) < max_new_tokens and token != eos:
        if not k:
            out = session(torch.tensor([[token]]))
            token = pick(out.logits[0, -1], temperature, generator)
            tokens.append(token)
            stats.target_forwards += 1
            continue
        # Draft: a chain of k tokens, each step appended to the drafter's cache, then undone.
        drafting = time.perf_counter()
        verified, drafts, draft_probs = draft_cache.length, [], []
        for i in range(k):
            if i:
                draft_logits, hidden = drafter.step(draft_cache, torch.tensor([[drafts[-1]]]), hidden[:, -1:])
            if temperature == 0:
                drafts.append(int(to_target[draft_logits[0, -1].argmax()]))
            else:
                q = draft_distribution(to_target, target.vocab_size, draft_logits[0, -1], temperature)
                drafts.append(int(torch.multinomial(q, 1, generator=generator)))
                draft_probs.append(q)
        draft_cache.crop(verified)
        # Verify: one target pass over the last emitted token and the k drafts.
        verifying = time.perf_counter()
        out = session(torch.tensor([[token, *drafts]]))
        stats.verify_s += time.perf_counter() - verifying
        stats.target_forwards += 1
        logits = out.logits[0]
        if temperature == 0:
            accepted, token = verify_greedy(drafts, logits)
        else:
            accepted, token = verify_sampling(drafts, torch.stack(draft_probs), logits, temperature, generator)
        stats.record(accepted)
        session.crop(session.length - (k - accepted))  # forget the rejected drafts
        new = drafts[:accepted] + [token]
        tokens += new
        # The drafter reads the target's features of the accepted positions and proposes the next chain.
        reading = time.perf_counter()
        draft_logits, hidden = drafter.step(draft_cache, torch.tensor([new]),
                                            drafter.fuse([h[:, : accepted + 1] for h in out.aux_hidden]))
        stats.draft_s += (verifying - drafting) + (time.perf_counter() - reading)
    stats.decode_s = time.perf_counter() - started - stats.ttft_s
    return Generation(truncate(tokens, max_new_tokens, eos), stats)


def draft_distribution(to_target: torch.Tensor, vocab_size: int, draft_logits: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """q over the target vocabulary: the drafter's tempered softmax, zero outside the draft vocab."""
    q = torch.zeros(vocab_size)
    q[to_target] = torch.softmax(draft_logits / temperature, -1)
    return q


def truncate(tokens: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Speculation may overshoot by up to k tokens; cut at max_new_tokens and after EOS."""
    tokens = tokens[:max_new_tokens]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
