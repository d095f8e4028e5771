"""Speculative decoding in one loop: draft K tokens, verify them in one target pass, accept,
emit the bonus token, roll both KV caches back past the rejected drafts.

Notation (Leviathan et al. 2023; Chen et al. 2023): p = the target's next-token
distribution, q = the drafter's. Greedy verification accepts the longest prefix of drafts
equal to the target's argmax. Sampling accepts draft x ~ q with probability
min(1, p(x)/q(x)) and on rejection samples from norm(max(0, p - q)), so every emitted token
is distributed exactly as the target alone would sample it. Both rules live once, in
kernels.verify (a Triton kernel on GPUs, its torch reference here).

Batch size 1. The target runs in a session (inference.sessions: a preallocated cache for
Llama-family targets, transformers' DynamicCache otherwise). What is drafted, and how, is a
Proposer's business (inference.drafting): a chain of K tokens, an EAGLE-2 dynamic tree, a
Medusa candidate tree, a one-pass parallel draft. The loop sees only a Draft (nodes and
parent links), verifies all of it in one target pass (tree attention when it is a tree),
keeps the accepted root-to-leaf path in the target's cache and hands the accepted tokens
with their target features back to the proposer.

Batches (generate_batch): B prompts decoded together, chains only; a batch of one is
`generate` itself, unchanged. See generate_batch for the scheme and why it stays exact.
"""

import itertools
import time
from dataclasses import dataclass, field

import torch

import forge_kernels as kernels
from common.config import UserError
from inference.batch_drafting import make_batch_proposer
from inference.draft import Draft
from inference.drafting import DraftingConfig, make_proposer
from inference.planning import make_planner
from inference.sessions import BatchSlots, open_session
from speculators.target import FrozenTarget, TargetOutput


@dataclass
class Stats:
    """Counters as vLLM defines them; one "draft" is one verification step."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    lookup_drafts: int = 0  # of num_drafts, n-gram lookup chains (drafting.prompt_lookup_max)
    lookup_accepted_tokens: int = 0  # of num_accepted_tokens, in lookup chains
    accepted_at: list[int] = field(default_factory=list)  # drafts whose token i was accepted, i = 1..the longest
    target_forwards: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0  # after the first token; of which:
    draft_s: float = 0.0  # drafter calls (chains, and reading the accepted positions)
    verify_s: float = 0.0  # target passes over the drafts
    token_latencies_s: list[float] = field(default_factory=list)  # per token after the first: its step's time / tokens
    # its row emitted in that step (a burst of accepted drafts shares the step's time)
    estimates: list[tuple[int, float, bool]] = field(default_factory=list)  # (position, acceptance estimate,
    # accepted) of every draft verified with its parent accepted, where the proposer estimated (drafting.plan)

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, accepted: int, proposed: int, looked_up: bool = False) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.lookup_drafts += looked_up
        self.lookup_accepted_tokens += accepted if looked_up else 0
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_length(self) -> float:
        """tau = 1 + accepted / drafts (vLLM's definition): tokens a verification pass yields, on average.
        Every report reads it here."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position i: the share of drafts whose token i was accepted."""
        return [a / max(self.num_drafts, 1) for a in self.accepted_at]

    def add(self, other: "Stats") -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "lookup_drafts",
                     "lookup_accepted_tokens", "target_forwards", "ttft_s", "decode_s", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_at = [a + b for a, b in itertools.zip_longest(self.accepted_at, other.accepted_at, fillvalue=0)]
        self.token_latencies_s += other.token_latencies_s
        self.estimates += other.estimates

    def record_estimates(self, estimates: list[float] | None, accepted: int) -> None:
        """The outcome of each estimated draft the target saw with its parent accepted."""
        for i, estimate in enumerate((estimates or [])[: accepted + 1]):
            self.estimates.append((i + 1, estimate, i < accepted))

    def emitted(self, counts: list[int], seconds: float) -> None:
        """One decode step took `seconds` and emitted counts[r] tokens in row r."""
        for count in counts:
            self.token_latencies_s += [seconds / count] * count


@dataclass
class Generation:
    tokens: list[int]
    stats: Stats


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=generator))


def chain_greedy(drafts: list[int], target_logits: torch.Tensor, tolerance: float = 0.0) -> tuple[int, int]:
    """(accepted count, next token): target_logits [k+1, V] from the pass over [last, *drafts];
    tolerance > 0 relaxes the rule (kernels/verify.py: typical acceptance, not the target's exact output)."""
    drafts = torch.tensor([drafts], dtype=torch.long, device=target_logits.device)
    accepted, token = kernels.verify_relaxed(drafts, target_logits[None], tolerance)
    return int(accepted), int(token)


def chain_sampled(drafts: list[int], draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    temperature: float, generator: torch.Generator) -> tuple[int, int]:
    """Lossless rejection sampling; draft_probs [k, V] is q in the target vocabulary."""
    device = target_logits.device  # draws from the seeded CPU generator, moved to the target's device
    uniform = torch.rand(1, len(drafts) + 1, generator=generator).to(device)
    accepted, token = kernels.verify_sampling(torch.tensor([drafts], dtype=torch.long, device=device),
                                              draft_probs[None].to(device), target_logits[None], temperature, uniform)
    return int(accepted), int(token)


def check_pair(target: FrozenTarget, drafter) -> None:
    """Refuse a drafter built for another target before generating anything."""
    problems = drafter.check(target)
    if problems:
        raise UserError("drafter does not fit the target: " + "; ".join(problems))


@torch.no_grad()
def generate(target: FrozenTarget, drafter, prompt: list[int], max_new_tokens: int, k: int = 5,
             temperature: float = 0.0, seed: int = 0, drafting: DraftingConfig | None = None,
             tolerance: float = 0.0) -> Generation:
    """Decode up to max_new_tokens after `prompt`; k=0 (or no drafter) is plain target decoding.
    `drafting` picks chain (the default) or tree drafts (greedy only), and with drafting.plan how much of
    each draft is verified (inference/planning.py); tolerance > 0 relaxes greedy chain verification
    (typical acceptance: faster, no longer the target's exact output)."""
    drafting = drafting or DraftingConfig()
    limit = target.config.max_position_embeddings
    if len(prompt) + max_new_tokens + k + 1 > limit:
        raise UserError(f"prompt of {len(prompt)} tokens + {max_new_tokens} new + {k} drafts exceeds the "
                        f"target's context of {limit} positions")
    if drafting.mode == "tree" and temperature > 0:
        raise UserError(f"drafting.mode=tree verifies greedily; temperature={temperature} needs drafting.mode=chain")
    if tolerance and (temperature > 0 or drafting.mode == "tree"):
        raise UserError(f"acceptance_tolerance={tolerance} relaxes greedy chains; it needs temperature=0 and "
                        f"drafting.mode=chain")
    k = k if drafter is not None else 0
    generator = torch.Generator().manual_seed(seed)
    eos = target.tokenizer.eos_token_id
    lookup = drafting.lookup_length(k)
    widest = max(drafting.tree_total_tokens if drafting.mode == "tree" else k, lookup)  # draft nodes in one pass
    max_len = len(prompt) + max_new_tokens + 1 + (widest if k else 0)
    stats, session = Stats(max(k, lookup)), open_session(target, max_len)
    started = time.perf_counter()
    device = target.device
    out = session(torch.tensor([prompt], device=device), logits="last")
    token = pick(out.logits[0, -1], temperature, generator)
    stats.target_forwards, stats.ttft_s = 1, time.perf_counter() - started
    tokens = [token]
    if k:
        proposer = make_proposer(drafter, k, target.vocab_size, max_len, drafting, device)
        if drafting.plan:
            proposer.planner = make_planner(target, drafter, k, drafting)
        proposer.prefill(prompt, token, out)
    while len(tokens) < max_new_tokens and token != eos:
        if not k:
            stepping = time.perf_counter()
            out = session(torch.tensor([[token]], device=device))
            token = pick(out.logits[0, -1], temperature, generator)
            tokens.append(token)
            stats.target_forwards += 1
            stats.emitted([1], time.perf_counter() - stepping)
            continue
        drafting_started = time.perf_counter()
        draft = proposer.propose(temperature, generator)
        # Verify: one target pass over the last emitted token (the root) and every draft node.
        verifying = time.perf_counter()
        start = session.length
        out = target_pass(session, token, draft)
        stats.verify_s += time.perf_counter() - verifying
        stats.target_forwards += 1
        path, token = verify(draft, out.logits[0], temperature, generator, tolerance)
        stats.record(len(path), len(draft.tokens), looked_up=draft.looked_up)
        if not draft.looked_up:  # the drafter's estimates (calibration, reliability), not lookup's counts
            stats.record_estimates(draft.estimates, len(path))
        rows = [0] + [node + 1 for node in path]  # the root and the accepted nodes
        session.keep(start, rows)  # forget the rejected drafts
        new = [draft.tokens[node] for node in path] + [token]
        tokens += new
        # The drafter reads the target's features of the accepted positions and proposes the next draft.
        reading = time.perf_counter()
        proposer.accept(new, select_rows(out, rows))
        drafter_seconds = (verifying - drafting_started) + (time.perf_counter() - reading)
        stats.draft_s += drafter_seconds
        if drafting.plan and not draft.looked_up:
            proposer.planner.record_draft(drafter_seconds, len(draft.tokens))
        stats.emitted([len(new)], time.perf_counter() - drafting_started)
    stats.decode_s = time.perf_counter() - started - stats.ttft_s
    return Generation(truncate(tokens, max_new_tokens, eos), stats)


@dataclass
class BatchGeneration:
    tokens: list[list[int]]  # per prompt, in the order given
    stats: Stats  # the whole batch: one draft per row per verification step; times are the batch's


@torch.no_grad()
def generate_batch(target: FrozenTarget, drafter, prompts: list[list[int]], max_new_tokens: int, k: int = 5,
                   temperature: float = 0.0, seed: int = 0, drafting: DraftingConfig | None = None,
                   tolerance: float = 0.0) -> BatchGeneration:
    """Decode several prompts together: one target pass per step verifies every row's chain.

    Prompts are left-padded to the longest. Each step every row drafts k tokens from its own last
    token, the target verifies all rows in one pass, and row r's verification accepts n_r of its
    drafts and yields y_{n_r+1} (its correction or bonus): row r emits y_1..y_{n_r+1}, exactly as
    it would alone, so greedy rows are their prompts' target-only output and sampled rows are
    lossless row by row. The caches stay rectangular: the batch goes on after the largest n_r, and
    the slots of drafts a row rejected below that become holes no later query sees
    (inference.sessions.BatchSlots); each row's positions count its own tokens. A cache therefore
    grows by up to k+1 slots a step whatever its row accepted: max_len allows k+1 per new token.
    Finished rows (EOS or max_new_tokens) leave the batch (select).

    Stats: one draft per row per step (vLLM's definitions), so tau = 1 + accepted/drafts is tokens
    emitted per row per target pass, comparable with batch 1. Drafting trees is refused: chains only.
    """
    drafting = drafting or DraftingConfig()
    if len(prompts) == 1:
        one = generate(target, drafter, prompts[0], max_new_tokens, k, temperature, seed, drafting, tolerance)
        return BatchGeneration([one.tokens], one.stats)
    if tolerance:
        raise UserError(f"acceptance_tolerance={tolerance} relaxes one prompt's verification; use batch_size=1")
    drafting.check_batch(len(prompts))
    longest = max(len(prompt) for prompt in prompts)
    limit = target.config.max_position_embeddings
    if longest + max_new_tokens + k + 1 > limit:
        raise UserError(f"prompt of {longest} tokens + {max_new_tokens} new + {k} drafts exceeds the "
                        f"target's context of {limit} positions")
    k = k if drafter is not None else 0
    generator = torch.Generator().manual_seed(seed)
    eos = target.tokenizer.eos_token_id
    device = target.device
    ids = torch.tensor([[0] * (longest - len(prompt)) + prompt for prompt in prompts], device=device)  # pads: any id
    max_len = longest + (max_new_tokens + 1) * (k + 1)
    slots = BatchSlots(torch.tensor([longest - len(prompt) for prompt in prompts], device=device), max_len)
    stats, session = Stats(k), open_session(target, max_len, slots)
    proposer = make_batch_proposer(drafter, k, target.vocab_size, max_len, slots, device) if k else None
    outputs: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # the prompt each batch row decodes
    started = time.perf_counter()
    out = session(ids, logits="last")
    new = pick_rows(out.logits[:, -1], temperature, generator)[:, None]
    stats.target_forwards, stats.ttft_s = 1, time.perf_counter() - started
    emitted = torch.ones(len(prompts), dtype=torch.long, device=device)  # tokens of `new` each row emits
    inputs = torch.cat([ids[:, 1:], new], 1)  # what the drafter reads next: the token after each position
    reads = torch.full_like(emitted, inputs.shape[1])  # of which each row's own (the rest are holes)
    step_started = time.perf_counter()
    while True:
        for row, (tokens, count) in enumerate(zip(new.tolist(), emitted.tolist())):
            outputs[rows[row]] += tokens[:count]
        if stats.target_forwards > 1:  # a decode step ended (the first pass is the prefill: time to first token)
            stats.emitted(emitted.tolist(), time.perf_counter() - step_started)
        step_started = time.perf_counter()
        going = [row for row, prompt in enumerate(rows) if len(outputs[prompt]) < max_new_tokens
                 and eos not in outputs[prompt][-int(emitted[row]):]]
        if not going:
            break
        if len(going) < len(rows):  # rows that finished leave the batch
            index = torch.tensor(going, device=device)
            rows, new, emitted, out = [rows[r] for r in going], new[index], emitted[index], select_batch(out, index)
            inputs, reads = inputs[index], reads[index]
            session.select(index)
            slots.select(index)
            if proposer:
                proposer.select(index)
        last = new.gather(1, emitted[:, None] - 1)[:, 0]  # each row's last emitted token
        if not k:
            out = session(last[:, None])
            new = pick_rows(out.logits[:, -1], temperature, generator)[:, None]
            stats.target_forwards += 1
            continue
        drafting_started = time.perf_counter()
        proposer.accept(inputs, out, reads)  # the prefill on the first step
        drafts, probs = proposer.propose(temperature, generator)
        verifying = time.perf_counter()
        start = session.length
        out = session(torch.cat([last[:, None], drafts], 1))
        stats.verify_s += time.perf_counter() - verifying
        stats.draft_s += verifying - drafting_started
        stats.target_forwards += 1
        if temperature == 0:
            accepted, token = kernels.verify_greedy(drafts, out.logits)
        else:
            uniform = torch.rand(len(drafts), k + 1, generator=generator).to(device)
            accepted, token = kernels.verify_sampling(drafts, probs, out.logits, temperature, uniform)
        for n in accepted.tolist():
            stats.record(n, k)
        # y_1..y_{n_r+1} of each row: its accepted drafts, then its correction or bonus token (then 0s: holes).
        widest = int(accepted.max()) + 1
        j = torch.arange(widest, device=device)[None]
        new = torch.where(j < accepted[:, None], torch.cat([drafts, token[:, None]], 1)[:, :widest],
                          torch.where(j == accepted[:, None], token[:, None], 0))
        emitted = reads = accepted + 1
        slots.keep(start, emitted, start + widest)  # row r keeps its root and n_r accepted drafts
        session.crop(start + widest)
        inputs, out = new, select_batch(out, torch.arange(widest, device=device), dim=1)
    stats.decode_s = time.perf_counter() - started - stats.ttft_s
    return BatchGeneration([truncate(tokens, max_new_tokens, eos) for tokens in outputs], stats)


def pick_rows(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row of logits [B, V]."""
    if temperature == 0:
        return logits.argmax(-1)
    drawn = torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=generator)
    return drawn[:, 0].to(logits.device)


def select_batch(out: TargetOutput, index: torch.Tensor, dim: int = 0) -> TargetOutput:
    return TargetOutput(aux_hidden=[h.index_select(dim, index) for h in out.aux_hidden],
                        last_hidden=out.last_hidden.index_select(dim, index), logits=out.logits.index_select(dim, index))


def target_pass(session, root: int, draft: Draft):
    """The target over [root, *draft]: causal for a chain, tree attention with depth positions for a tree."""
    device = session.target.device
    tokens = torch.tensor([[root, *draft.tokens]], device=device)
    if draft.is_chain:
        return session(tokens)
    depths = torch.tensor([0, *draft.depths()], device=device)
    return session(tokens, tree=draft.tree_mask().to(device), depths=depths)


def verify(draft: Draft, logits: torch.Tensor, temperature: float, generator: torch.Generator,
           tolerance: float = 0.0) -> tuple[list[int], int]:
    """(accepted nodes root to leaf, the next token) from the target logits [1 + n, V] of the pass."""
    if draft.is_chain:
        if temperature == 0:
            accepted, token = chain_greedy(draft.tokens, logits, tolerance)
        else:
            accepted, token = chain_sampled(draft.tokens, draft.probs, logits, temperature, generator)
        return list(range(accepted)), token
    return verify_tree_greedy(draft, logits)


def verify_tree_greedy(draft: Draft, logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk down from the root, at each node following the child equal to the target's argmax
    there; the argmax at the last accepted node is the bonus token."""
    argmax = logits.argmax(-1).tolist()
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(draft.parents):
        children.setdefault(parent, {}).setdefault(draft.tokens[node], node)
    path, node = [], -1
    while (child := children.get(node, {}).get(argmax[node + 1])) is not None:
        path.append(child)
        node = child
    return path, argmax[node + 1]


def select_rows(out: TargetOutput, rows: list[int]) -> TargetOutput:
    index = torch.tensor(rows, device=out.logits.device)
    return TargetOutput(aux_hidden=[h[:, index] for h in out.aux_hidden], last_hidden=out.last_hidden[:, index],
                        logits=out.logits[:, index])


def truncate(tokens: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Speculation may overshoot by up to k tokens; cut at max_new_tokens and after EOS."""
    tokens = tokens[:max_new_tokens]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
