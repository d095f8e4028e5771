"""Draft proposers: how a drafter proposes the tokens the target verifies in its next pass.

A proposal is a `Draft`: nodes with target-vocab tokens and parent links. A chain of K
tokens is the tree whose parents are [-1, 0, ..., K-2] (-1 is the root: the last emitted
token). The engine verifies any Draft in one target pass with tree attention (a chain's
tree mask is the causal mask), so a new way of drafting is a new Proposer, nothing else.

A Proposer lives for one generation and holds the drafter's cache:
- `prefill(prompt, token, target_out)`: read the prompt's target features; `token` is the
  first emitted token;
- `propose(temperature, generator) -> Draft`;
- `accept(new_tokens, target_out)`: the accepted drafts and the bonus token, with the verify
  pass's features of the positions before each of them.

The table PROPOSERS maps (drafter.drafting_kind, mode) to a proposer class.

Batches (engine.generate_batch) draft chains through inference/batch_drafting.py.
"""

from dataclasses import dataclass

import torch

from common.config import UserError, at_least, one_of, require
from inference.draft import Draft, draft_distribution, planned, sample
from inference.lookup import LookupProposer
from inference.planning import logit
from inference.sessions import open_session
from speculators.target import TargetOutput


@dataclass
class DraftingConfig:
    mode: str = "chain"  # chain: K tokens in a row; tree: EAGLE-2 dynamic tree / Medusa candidate tree (greedy only)
    tree_top_k: int = 4  # EAGLE-2: children expanded per node, and frontier width per depth
    tree_total_tokens: int = 16  # EAGLE-2: nodes kept (verified) after reranking by cumulative log-probability
    prompt_lookup_max: int = 0  # > 0: draft a chain by n-gram lookup when one matches (LookupProposer), else the drafter
    prompt_lookup_min: int = 2  # the shortest n-gram that counts as a match
    prompt_lookup_tokens: int | None = None  # tokens in a lookup chain; None: K
    chain_min_prob: float = 0.0  # > 0: an EAGLE chain stops before a draft its drafter's top probability is below
    # (llama.cpp's --draft-p-min); the first draft is always made, as verifying it costs next to nothing
    plan: bool = False  # verify the prefix with the most expected tokens per second (inference/planning.py), up to K
    cost_table: str | None = None  # the target's step costs (planning.StepCosts); null: cached per target and machine
    remeasure: bool = False  # measure the step costs again even where a table is cached
    calibration: str | None = None  # per-position temperatures (sts.json); null: the drafter's own, if it has them

    def __post_init__(self):
        one_of("drafting.mode", self.mode, ("chain", "tree"))
        at_least(1, drafting__tree_top_k=self.tree_top_k, drafting__tree_total_tokens=self.tree_total_tokens,
                 drafting__prompt_lookup_min=self.prompt_lookup_min)
        require(self.prompt_lookup_max == 0 or self.prompt_lookup_max >= self.prompt_lookup_min,
                "drafting.prompt_lookup_max", self.prompt_lookup_max,
                f"0 (off) or at least drafting.prompt_lookup_min={self.prompt_lookup_min}")
        require(0 <= self.chain_min_prob < 1, "drafting.chain_min_prob", self.chain_min_prob, "in [0, 1) (0: off)")
        require(not (self.plan and self.chain_min_prob), "drafting.chain_min_prob", self.chain_min_prob,
                "0 with drafting.plan=true (the plan decides where a chain stops)")
        require(not (self.plan and self.mode == "tree"), "drafting.plan", self.plan,
                "false with drafting.mode=tree (plans verify a prefix of a chain)")

    def check_batch(self, batch_size: int) -> None:
        """Batches draft fixed-length chains: refuse what drafts one prompt at a time, with one line."""
        if batch_size == 1:
            return
        if self.mode == "tree":
            raise UserError(f"drafting.mode=tree decodes one prompt at a time; batch_size={batch_size} needs "
                            f"drafting.mode=chain (or batch_size=1)")
        if self.prompt_lookup_max:
            raise UserError(f"drafting.prompt_lookup_max={self.prompt_lookup_max}: n-gram lookup drafts one prompt "
                            f"at a time; use batch_size=1 (or drafting.prompt_lookup_max=0)")
        if self.chain_min_prob or self.plan:
            raise UserError("drafting.chain_min_prob / drafting.plan: chains of their own length draft one "
                            "prompt at a time; use batch_size=1")

    def lookup_length(self, k: int) -> int:
        """Tokens in a lookup chain next to the drafter's K; 0 with lookup off."""
        return (self.prompt_lookup_tokens or k) if self.prompt_lookup_max else 0


def lookup_drafting(tokens: int, plan: bool = False) -> DraftingConfig:
    """N-gram lookup in front of the drafter as the reports serve it: a chain of up to `tokens` where the
    context's last 3 (or 2) tokens occurred before, planned from its own counts with `plan`."""
    return DraftingConfig(prompt_lookup_max=3, prompt_lookup_tokens=tokens, plan=plan)


class DrafterCacheProposer:
    """A trained drafter with a cache of its own over the verified positions; the prefill reads the
    prompt's target features, position t with token t+1 (the first emitted token last)."""

    planner = None  # an inference.planning.Planner: how many drafts to verify (drafting.plan)

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
        self.drafter, self.k, self.vocab_size, self.device = drafter, k, vocab_size, device
        self.to_target = drafter.draft_to_target  # draft id -> target id, once per generation
        self.cache = drafter.new_cache(1, max_len, device)

    def prefill(self, prompt: list[int], token: int, target_out: TargetOutput) -> None:
        self.accept(prompt[1:] + [token], target_out)


class ChainProposer(DrafterCacheProposer):
    """EAGLE-1/3 chains: K drafter steps, each feeding its output hidden state to the next.
    Drafter cache position t holds (token t+1, features of position t); the drafted steps
    are appended and then cropped, so the cache only ever keeps verified positions.
    With drafting.chain_min_prob the chain ends early where the drafter is unsure. The
    decision reads the drafter's distribution, never the token drawn from it, so sampled
    verification stays lossless."""

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
        super().__init__(drafter, k, vocab_size, max_len, drafting, device)
        self.min_prob = drafting.chain_min_prob

    def accept(self, new_tokens: list[int], target_out: TargetOutput) -> None:
        self.logits, self.hidden = self.drafter.step(self.cache, torch.tensor([new_tokens], device=self.device),
                                                     self.drafter.features(target_out))

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        verified, tokens, probs, estimates = self.cache.length, [], [], []
        logits, hidden = self.logits, self.hidden
        for i in range(self.k):
            if self.planner and not self.planner.worth_drafting(estimates, self.k):
                break
            if i:
                logits, hidden = self.drafter.step(self.cache, torch.tensor([tokens[-1:]], device=self.device),
                                                   hidden[:, -1:])
            top = float(torch.softmax(logits[0, -1], -1).max()) if self.min_prob or self.planner else 1.0
            if i and self.min_prob and top < self.min_prob:
                break
            if self.planner:
                estimates.append(self.planner.calibrated(i + 1, logit(top)))
                if not self.planner.worth_verifying(estimates, self.k):
                    estimates.pop()
                    break
            if temperature == 0:
                tokens.append(int(self.to_target[logits[0, -1].argmax()]))
            else:
                q = draft_distribution(self.to_target, self.vocab_size, logits[0, -1], temperature)
                tokens.append(int(sample(q, generator)))
                probs.append(q)
        self.cache.crop(verified)
        return Draft.chain(tokens, torch.stack(probs) if probs else None, estimates=estimates or None)


class DynamicTreeProposer(ChainProposer):
    """EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv:2406.16858), greedy verification.

    Depth by depth, the `top_k` frontier nodes with the highest cumulative log-probability
    are run through the drafter together (tree attention over its cache: each sees the
    verified context and its own ancestors) and each proposes its `top_k` best children.
    After K depths every generated node is reranked by cumulative log-probability and the
    best `total_tokens` form the draft. A child never outranks its parent (log-probs are
    <= 0), so the kept set is a tree.
    """

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
        super().__init__(drafter, k, vocab_size, max_len, drafting, device)
        self.top_k, self.total_tokens = drafting.tree_top_k, drafting.tree_total_tokens

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        verified = self.cache.length
        tokens, parents, scores, depths = [], [], [], []  # every generated node

        def add_children(parent: int, score: float, depth: int, logits: torch.Tensor) -> list[int]:
            best = torch.log_softmax(logits, -1).topk(self.top_k)
            for logp, draft_id in zip(best.values.tolist(), best.indices.tolist()):
                tokens.append(int(self.to_target[draft_id]))
                parents.append(parent)
                scores.append(score + logp)
                depths.append(depth)
            return list(range(len(tokens) - self.top_k, len(tokens)))

        candidates = add_children(-1, 0.0, 1, self.logits[0, -1])
        parent_hidden = {-1: self.hidden[0, -1]}  # output hidden of each node run through the drafter
        slot = {}  # node -> drafter cache slot, for the nodes run through the drafter
        for depth in range(1, self.k):
            frontier = sorted(candidates, key=lambda n: -scores[n])[: self.top_k]
            slot |= {n: len(slot) + i for i, n in enumerate(frontier)}
            logits, hidden = self.drafter.step(
                self.cache, torch.tensor([[tokens[n] for n in frontier]], device=self.device),
                torch.stack([parent_hidden[parents[n]] for n in frontier])[None],
                positions=torch.full((len(frontier),), verified + depth - 1, device=self.device),
                visible=self.visibility(verified, frontier, parents, slot).to(self.device))
            candidates = []
            for i, n in enumerate(frontier):
                parent_hidden[n] = hidden[0, i]
                candidates += add_children(n, scores[n], depth + 1, logits[0, i])
        self.cache.crop(verified)
        return self.rerank(tokens, parents, scores, depths)

    def visibility(self, verified: int, frontier: list[int], parents: list[int], slot: dict) -> torch.Tensor:
        """[f, verified + drafted slots] bool: the verified context, then each node's own ancestors and itself."""
        visible = torch.zeros(len(frontier), verified + len(slot), dtype=torch.bool)
        visible[:, :verified] = True
        for row, n in enumerate(frontier):
            while n >= 0:
                visible[row, verified + slot[n]] = True
                n = parents[n]
        return visible

    def rerank(self, tokens, parents, scores, depths) -> Draft:
        """The best `total_tokens` nodes, parents before children, re-indexed."""
        order = sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n]))
        kept: dict[int, int] = {}  # old index -> new index
        for n in order:
            if len(kept) == self.total_tokens:
                break
            if parents[n] < 0 or parents[n] in kept:
                kept[n] = len(kept)
        nodes = sorted(kept, key=lambda n: (depths[n], kept[n]))
        new_index = {n: i for i, n in enumerate(nodes)}
        return Draft([tokens[n] for n in nodes], [new_index[parents[n]] if parents[n] >= 0 else -1 for n in nodes])


PROPOSERS = {
    ("autoregressive", "chain"): ChainProposer,
    ("autoregressive", "tree"): DynamicTreeProposer,
}


def modes(drafter) -> list[str]:
    """The drafting modes a drafter can be served with."""
    kind = drafter.drafting_kind
    return sorted(mode for (family_kind, mode) in PROPOSERS if family_kind == kind)


def serving_k(drafter, k: int | None) -> int:
    """The K every command serves: the user's, else the drafter's own (drafter.k: the fastest its report measured,
    else its depth). A K above the trained depth is served and said in one line where the family can draft it,
    refused in one line where it cannot (Medusa's heads, DFlash's block)."""
    if k is None:
        return drafter.k
    if k > drafter.depth:
        if not drafter.drafts_beyond_depth:
            raise UserError(f"k={k}: this {type(drafter).__name__} drafts at most {drafter.depth} tokens (its "
                            f"trained depth)")
        print(f"k={k} is beyond the {drafter.depth} draft tokens this drafter was trained for: "
              f"positions past {drafter.depth} are served untrained")
    return k


def make_proposer(drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
    """The proposer of `drafter` in `drafting.mode`; its tensors on `device` (the target's)."""
    if drafting.mode not in modes(drafter):
        raise UserError(f"drafting.mode={drafting.mode!r} is not available for a {type(drafter).__name__}; "
                        f"allowed: {', '.join(modes(drafter))}")
    proposer_class = PROPOSERS[drafter.drafting_kind, drafting.mode]
    if drafting.plan and proposer_class not in PLANNED:
        raise UserError(f"drafting.plan verifies a prefix of a chain; a {type(drafter).__name__} in "
                        f"drafting.mode={drafting.mode} drafts otherwise (set drafting.plan=false)")
    if drafting.chain_min_prob and proposer_class is not ChainProposer:
        raise UserError(f"drafting.chain_min_prob={drafting.chain_min_prob} ends EAGLE chains early; a "
                        f"{type(drafter).__name__} in drafting.mode={drafting.mode} drafts otherwise (set it to 0)")
    proposer = proposer_class(drafter, k, vocab_size, max_len, drafting, device)
    if drafting.prompt_lookup_max:
        return LookupProposer(proposer, k, vocab_size, drafting)
    return proposer


class ParallelProposer(DrafterCacheProposer):
    """P-EAGLE (speculators.peagle): one drafter pass per draft. `accept` only records the
    verified positions; `propose` appends them to the drafter's caches and, in the same pass,
    reads the k drafts off the last verified position and k-1 mask positions after it (the
    drafter crops those again). The drafts do not condition on each other, so a chain's
    tokens come from k independent distributions: argmax each (greedy), or sample each from
    q in the target vocabulary (rejection sampling stays lossless for any q). Positions not yet read
    (a LookupProposer drafted instead) wait for the next proposal."""

    unread: tuple[torch.Tensor, torch.Tensor] | None = None  # verified tokens [1, m] and their features

    def accept(self, new_tokens: list[int], target_out: TargetOutput) -> None:
        tokens, features = torch.tensor([new_tokens], device=self.device), self.drafter.features(target_out)
        if self.unread is not None:
            tokens, features = torch.cat([self.unread[0], tokens], 1), torch.cat([self.unread[1], features], 1)
        self.unread = tokens, features

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        logits = self.drafter.draft(self.cache, *self.unread, self.k)
        self.unread = None
        draft = independent_drafts(self.to_target, self.vocab_size, logits, temperature, generator)
        return planned(self.planner, draft, torch.softmax(logits, -1).amax(-1))


def independent_drafts(to_target, vocab_size: int, logits: torch.Tensor, temperature: float,
                       generator: torch.Generator) -> Draft:
    """A chain of drafts that do not condition on each other, one per row of draft-vocab logits [k, N]: argmax
    each (greedy), or sample each from q in the target vocabulary (rejection sampling stays lossless for any q)."""
    if temperature == 0:
        return Draft.chain(to_target[logits.argmax(-1)].tolist())
    q = torch.stack([draft_distribution(to_target, vocab_size, row, temperature) for row in logits])
    return Draft.chain(sample(q, generator)[:, 0].tolist(), q)


PROPOSERS["parallel", "chain"] = ParallelProposer


class BlockProposer(ParallelProposer):
    """DSpark (speculators.dspark): one backbone pass over the block, then its slots decoded left to right, each
    through the Markov bias of the token before it (the anchor, then the previous draft), argmax or sampled from
    its own q. Each slot's confidence head gives the estimate a plan reads; with a planner, drafting stops at
    the first slot not worth verifying (the decision reads the confidence, which depends only on the drafts
    before that slot, so sampled verification stays lossless). Without one, every slot up to K is drafted."""

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        prev = int(self.unread[0][0, -1])  # the anchor: the token the target just emitted
        normed = self.drafter.draft_block(self.cache, *self.unread)
        self.unread = None
        tokens, probs, estimates, state = [], [], [], None
        for j in range(self.k):
            if self.planner:  # the confidence first: a slot not worth verifying is never decoded
                estimates.append(self.planner.calibrated(j + 1, self.drafter.slot_confidence(normed[j], prev)))
                if j and not self.planner.keep_going(estimates, self.k):
                    estimates.pop()
                    break
            logits, state = self.drafter.slot(normed[j], prev, state)
            if temperature == 0:
                prev = int(self.to_target[logits.argmax()])
            else:
                q = draft_distribution(self.to_target, self.vocab_size, logits, temperature)
                prev = int(sample(q, generator))
                probs.append(q)
            tokens.append(prev)
        return Draft.chain(tokens, torch.stack(probs) if probs else None, estimates=estimates or None)


PROPOSERS["block", "chain"] = BlockProposer


class MedusaChainProposer:
    """Medusa (speculators.medusa), a chain: draft i comes from head i at the last verified
    position (whose next token is the bonus token just emitted, so head i drafts the token i
    after it). No drafter cache: the heads read that one position's last hidden state. The
    drafts do not condition on each other: argmax each (greedy), or sample each from its
    head's tempered softmax, q over the target vocabulary (Medusa's is the target's). Each head
    projects onto the whole vocabulary, so heads are computed one at a time and, with a planner,
    only while the next draft may be worth verifying (as a chain's steps)."""

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
        if k > drafter.depth:
            raise UserError(f"k={k} is not valid: a Medusa drafter with "
                            f"{drafter.depth} heads drafts at most {drafter.depth}")
        self.drafter, self.k = drafter, k
        self.planner = None  # an inference.planning.Planner (drafting.plan)

    def prefill(self, prompt: list[int], token: int, target_out: TargetOutput) -> None:
        self.accept([token], target_out)

    def accept(self, new_tokens: list[int], target_out: TargetOutput) -> None:
        self.last = target_out.last_hidden[:, -1]  # [1, H]

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        tokens, probs, estimates = [], [], []
        for i in range(self.k):
            if self.planner and not self.planner.worth_drafting(estimates, self.k):
                break
            logits = self.drafter.head_logits(self.last, range(i, i + 1))[0, 0]
            if self.planner:
                estimates.append(self.planner.calibrated(i + 1, logit(float(torch.softmax(logits, -1).max()))))
                if not self.planner.worth_verifying(estimates, self.k):
                    estimates.pop()
                    break
            if temperature == 0:
                tokens.append(int(logits.argmax()))
            else:
                probs.append(torch.softmax(logits / temperature, -1))
                tokens.append(int(sample(probs[-1], generator)))
        return Draft.chain(tokens, torch.stack(probs) if probs else None, estimates=estimates or None)


class MedusaTreeProposer(MedusaChainProposer):
    """Medusa's candidate tree, greedy verification: the drafter's `tree_choices`, where path
    [r_1, ..., r_d] is the node holding head d's r_d-th best token (0 = argmax), child of
    [r_1, ..., r_{d-1}]. Kept: the paths no deeper than k and, of those, the first
    `tree_total_tokens` in the config's order (parents are listed first, so every prefix is a
    tree), the number of nodes the engine makes room for in its verify pass."""

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
        super().__init__(drafter, k, vocab_size, max_len, drafting, device)
        kept = [tuple(path) for path in drafter.cfg.tree_choices if len(path) <= k][: drafting.tree_total_tokens]
        self.paths = sorted(kept, key=lambda path: (len(path), path))  # by depth: parents before children
        node = {path: i for i, path in enumerate(self.paths)}
        self.parents = [node[path[:-1]] if len(path) > 1 else -1 for path in self.paths]
        self.ranks = 1 + max(max(path) for path in self.paths)  # candidates needed per head
        self.depth = max(len(path) for path in self.paths)  # the heads the tree reads

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        heads = self.drafter.head_logits(self.last, range(self.depth))[0]
        best = heads.topk(self.ranks, dim=-1).indices.tolist()  # [depth, ranks]: head i's candidates, best first
        return Draft([best[len(path) - 1][path[-1]] for path in self.paths], list(self.parents))


PROPOSERS["heads", "chain"] = MedusaChainProposer
PLANNED = (ChainProposer, ParallelProposer, BlockProposer, MedusaChainProposer)  # proposers a planner trims
PROPOSERS["heads", "tree"] = MedusaTreeProposer


class SelfProposer:
    """Quantized self-speculation (speculators/self_draft.py): the target's low-bit copy decodes k
    tokens in its own session, greedy or sampled (q = its tempered softmax, over the target's own
    vocabulary). The copy reads drafts 1..k-1 while drafting; after verification it keeps those the
    target accepted and reads only the rest of what was emitted (usually the target's own token);
    after a cycle it did not draft (a LookupProposer's), it reads all of it."""

    def __init__(self, drafter, k: int, vocab_size: int, max_len: int, drafting: DraftingConfig, device=None):
        self.k, self.session, self.device = k, open_session(drafter.copy, max_len), device
        self.drafted = False  # whether the copy's cache holds drafts of the cycle being accepted

    def prefill(self, prompt: list[int], token: int, target_out: TargetOutput) -> None:
        self.read(prompt + [token])

    def read(self, tokens: list[int]) -> None:
        self.logits = self.session(torch.tensor([tokens], device=self.device), logits="last").logits[0, -1]

    def accept(self, new_tokens: list[int], target_out: TargetOutput) -> None:
        read_drafts = 0  # accepted drafts already in the copy's cache
        if self.drafted:
            read_drafts = min(len(new_tokens) - 1, self.k - 1)
            self.session.crop(self.verified + read_drafts)
        self.read(new_tokens[read_drafts:])
        self.drafted = False

    def propose(self, temperature: float, generator: torch.Generator) -> Draft:
        self.verified, self.drafted, tokens, probs = self.session.length, True, [], []
        logits = self.logits
        for i in range(self.k):
            if i:
                logits = self.session(torch.tensor([tokens[-1:]], device=self.device)).logits[0, -1]
            if temperature == 0:
                tokens.append(int(logits.argmax()))
            else:
                q = torch.softmax(logits / temperature, -1)
                tokens.append(int(sample(q, generator)))
                probs.append(q)
        return Draft.chain(tokens, torch.stack(probs) if probs else None)


PROPOSERS["self", "chain"] = SelfProposer
