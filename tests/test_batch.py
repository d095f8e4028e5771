"""Batched speculative decoding (inference.engine.generate_batch): B prompts of different lengths,
left-padded, one target pass per step, every row advancing by its own accepted count.

1. Padding is invisible: the target session and the drafter give each row of a padded batch what
   they give that prompt alone.
2. Greedy is exact: every row equals its prompt's target-only greedy output, with a random EAGLE-3
   drafter, a Medusa drafter, and an oracle whose rows accept different counts (so their caches
   get holes), including a row that stops early at EOS; static and HF sessions. Each row drafts
   and accepts in the batch what it does alone.
3. Sampling is lossless: chi-square of each row's first generated tokens against the target's law.
4. Refusals: tree drafts and P-EAGLE with B > 1, in one line; a batch of one is `generate`.
5. The report groups prompts by batch_size and keeps its shape.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import LAYER_IDS
from test_medusa import make_medusa
from test_sampling import ALPHA, chi2_sf, chi_square, tiny_target

from common.config import UserError
from inference import engine, evalsets, report
from inference.batch_drafting import make_batch_proposer
from inference.drafting import ChainProposer, DraftingConfig
from inference.engine import generate, generate_batch
from inference.sessions import BatchSlots, HFSession
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from speculators.target import FrozenTarget

MAX_NEW = 40


def prompts_of(text_batch) -> list[list[int]]:
    """Three prompts of 12, 15 and 5 tokens: rows padded by 3, 0 and 10."""
    return [text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist(), text_batch[0, 20:25].tolist()]


@pytest.fixture(params=["static", "hf"])
def session(request, monkeypatch):
    """The static session (Llama, Qwen3) or transformers with a DynamicCache (every other architecture)."""
    if request.param == "hf":
        monkeypatch.setattr(engine, "open_session", lambda target, max_len, slots=None: HFSession(target, slots))
    return request.param


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(map(len, prompts))
    pads = torch.tensor([longest - len(p) for p in prompts])
    return torch.tensor([[0] * (longest - len(p)) + p for p in prompts]), pads


# --- 1. padding is invisible ----------------------------------------------------------------------


def test_padded_rows_see_what_each_prompt_alone_sees(target, make_drafter, text_batch, session):
    prompts, k = prompts_of(text_batch), 4
    ids, pads = padded(prompts)
    slots = BatchSlots(pads, 64)
    batch = engine.open_session(target, 64, slots)
    out = batch(ids)
    first = out.logits[:, -1].argmax(-1)
    drafter = make_drafter(target)
    proposer = make_batch_proposer(drafter, k, target.vocab_size, 64, slots)
    proposer.accept(torch.cat([ids[:, 1:], first[:, None]], 1), out, torch.full_like(pads, ids.shape[1]))
    drafts, probs = proposer.propose(0.0, None)
    assert probs is None and drafts.shape == (3, k)
    for r, prompt in enumerate(prompts):
        alone = engine.open_session(target, 64)(torch.tensor([prompt]))
        pad = int(pads[r])
        torch.testing.assert_close(out.logits[r, pad:], alone.logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.aux_hidden[0][r, pad:], alone.aux_hidden[0][0], atol=1e-4, rtol=1e-4)
        single = ChainProposer(drafter, k, target.vocab_size, 64, DraftingConfig())
        single.prefill(prompt, int(first[r]), alone)
        torch.testing.assert_close(proposer.logits[r, -1], single.logits[0, -1], atol=1e-4, rtol=1e-4)
        assert drafts[r].tolist() == single.propose(0.0, None).tokens


def test_batch_slots_turn_rejected_drafts_into_holes_and_keep_each_rows_positions():
    slots = BatchSlots(torch.tensor([2, 0]), 12)  # row 0 has 2 pads before its 3-token prompt, row 1 none
    assert slots.valid[:, :5].tolist() == [[False, False, True, True, True], [True] * 5]
    # A pass over slots 5..8 (a root and 3 drafts): row 0 keeps its root and 1 draft, row 1 all 4.
    slots.keep(5, torch.tensor([2, 4]), 9)
    assert slots.valid[0, 5:10].tolist() == [True, True, False, False, True]
    assert slots.positions(9, 11).tolist() == [[5, 6], [9, 10]]  # each row's own count of tokens
    seen = slots.visible(9, 10)[:, 0, 0]
    assert seen[0].tolist() == [False, False, True, True, True, True, True, False, False, True]
    assert seen[1].tolist() == [True] * 10


# --- 2. greedy is exact ----------------------------------------------------------------------------


class OracleCache:
    """length and crop, as the drafter's KVCache; `k` holds each row's prompt index, so that the
    proposer's select() (which indexes k and v) keeps the rows' identities with the rows."""

    def __init__(self, rows: int, max_len: int):
        self.length, self.max_len = 0, max_len
        self.k = torch.arange(rows)
        self.v = self.k.clone()

    def crop(self, length: int) -> None:
        self.length = length


class BatchOracle:
    """Knows each prompt's greedy continuation seqs[r] (prompt + output). At row r's position t it
    proposes seqs[r][t + 2] (what a drafter there is trained to predict) except where wrong(r, t).
    The engine passes each row's own positions (s - pads[r]), which the oracle reads."""

    drafting_kind = "autoregressive"

    def __init__(self, target, seqs: list[list[int]], wrong):
        self.seqs, self.wrong, self.vocab_size = seqs, wrong, target.vocab_size
        self.draft_to_target = torch.arange(self.vocab_size)

    def new_cache(self, batch: int, max_len: int, device=None) -> OracleCache:
        return OracleCache(batch, max_len)

    def features(self, target_out) -> torch.Tensor:
        return target_out.last_hidden

    def step(self, cache: OracleCache, tokens, hidden, positions, visible):
        B, m = tokens.shape
        assert positions.shape == (B, 1, m) and visible.shape == (B, 1, m, cache.length + m)
        cache.length += m
        assert cache.length <= cache.max_len
        logits = torch.zeros(B, m, self.vocab_size)
        for row, prompt in enumerate(cache.k.tolist()):
            for i, t in enumerate(positions[row, 0].tolist()):
                seq = self.seqs[prompt]
                right = seq[t + 2] if t + 2 < len(seq) else 0
                logits[row, i, (right + 1) % self.vocab_size if self.wrong(prompt, t) else right] = 10.0
        return logits, hidden


def wrong_per_row(prompt: int, t: int) -> bool:
    """Row 0 never misses, row 1 every 5th position, row 2 at irregular gaps: different accepted counts."""
    return (prompt == 1 and t % 5 == 0) or (prompt == 2 and t % 9 in (0, 3))


def with_eos_early(target, prompts: list[list[int]]) -> tuple[FrozenTarget, list[list[int]]]:
    """The target with an EOS chosen so that row 2 stops after a few tokens and another row goes on
    longer; and each prompt's target-only greedy output under it."""
    free = generate(target, None, prompts[2], MAX_NEW, k=0).tokens
    for eos in free[4:20]:
        with_eos = FrozenTarget(target.model, SimpleNamespace(eos_token_id=eos), "eos", LAYER_IDS)
        bases = [generate(with_eos, None, prompt, MAX_NEW, k=0).tokens for prompt in prompts]
        if len(bases[2]) < 20 and max(map(len, bases)) > len(bases[2]) + 5:
            return with_eos, bases
    pytest.fail("no EOS candidate stops row 2 early and lets another row go on")


@pytest.mark.parametrize("eos", [False, True])
def test_greedy_batch_equals_target_only_greedy(target, make_drafter, text_batch, session, eos):
    prompts, k = prompts_of(text_batch), 4
    if eos:
        target, bases = with_eos_early(target, prompts)
    else:
        bases = [generate(target, None, prompt, MAX_NEW, k=0).tokens for prompt in prompts]
        assert all(len(b) == MAX_NEW for b in bases)
    assert generate_batch(target, None, prompts, MAX_NEW, k=0).tokens == bases  # plain batched decoding

    random = generate_batch(target, make_drafter(target), prompts, MAX_NEW, k=k)
    assert random.tokens == bases

    # The oracle: rows accept different counts (row 0 all its drafts), each as many as it does alone,
    # which a batch of two copies of its prompt measures.
    seqs = [p + generate(target, None, p, MAX_NEW + k + 2, k=0).tokens for p in prompts]
    batch = generate_batch(target, BatchOracle(target, seqs, wrong_per_row), prompts, MAX_NEW, k=k)
    assert batch.tokens == bases
    stats = batch.stats
    assert stats.num_draft_tokens == k * stats.num_drafts and stats.target_forwards > 1
    assert sum(stats.accepted_at) == stats.num_accepted_tokens
    alone = [generate_batch(target, BatchOracle(target, [seqs[r]] * 2, lambda prompt, t, r=r: wrong_per_row(r, t)),
                            [prompts[r]] * 2, MAX_NEW, k=k) for r in range(len(prompts))]
    assert [a.tokens for a in alone] == [[b] * 2 for b in bases]
    assert alone[0].stats.num_accepted_tokens == alone[0].stats.num_draft_tokens  # never wrong: k+1 a pass
    for counter in ("num_drafts", "num_accepted_tokens"):
        assert 2 * getattr(stats, counter) == sum(getattr(a.stats, counter) for a in alone), counter
    assert stats.target_forwards == max(a.stats.target_forwards for a in alone)


def test_greedy_batch_with_medusa_equals_target_only_greedy(llama_target, text_batch):
    prompts = prompts_of(text_batch)
    bases = [generate(llama_target, None, prompt, MAX_NEW, k=0).tokens for prompt in prompts]
    batch = generate_batch(llama_target, make_medusa(llama_target).eval(), prompts, MAX_NEW, k=3)
    assert batch.tokens == bases and batch.stats.num_drafts > 0


# --- 3. sampling is lossless -----------------------------------------------------------------------


def test_batch_sampling_emits_the_target_distribution():
    """Per row, (x1, x2) (the two tokens after the prefill's x0) over many seeds against the target's
    joint law, as test_engine's single-prompt test. With max_new_tokens=3 a row whose first
    verification accepted 2 drafts emits x1 and x2 in one step while a row that accepted none
    draws x2 in the next, beside holes in the first row's cache."""
    V, k, runs = 8, 3, 1500
    target = tiny_target(V)
    torch.manual_seed(2)
    drafter = Eagle3Drafter.from_target(Eagle3Config(draft_vocab_size=6), target, torch.arange(V, 0, -1))
    prompts = [[1, 5, 2, 7], [3, 6], [4, 4, 0, 2, 5, 1]]
    seen = torch.zeros(len(prompts), V, V)
    accepted = drafts = 0
    for seed in range(runs):
        g = generate_batch(target, drafter, prompts, 3, k=k, temperature=1.0, seed=seed)
        for row, tokens in enumerate(g.tokens):
            assert len(tokens) == 3
            seen[row, tokens[1], tokens[2]] += 1
        accepted += g.stats.num_accepted_tokens
        drafts += g.stats.num_drafts
    assert 0.2 < accepted / drafts < 0.8 * k  # accepts and rejects

    for row, prompt in enumerate(prompts):
        p0 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        x0 = torch.arange(V)[:, None]
        p1 = torch.softmax(target(torch.cat([torch.tensor([prompt] * V), x0], 1)).logits[:, -1].double(), -1)
        pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        p2 = torch.softmax(target(torch.cat([torch.tensor([prompt] * V * V), pairs], 1)).logits[:, -1].double(), -1)
        joint = (p0[:, None, None] * p1[:, :, None] * p2.view(V, V, V)).sum(0)  # [x1, x2]
        stat, df = chi_square(seen[row], joint)
        assert chi2_sf(stat, df) > ALPHA, (row, stat, df)


# --- 4. refusals and the batch of one --------------------------------------------------------------


def test_tree_drafts_and_parallel_drafters_refuse_batches_in_one_line(llama_target, make_drafter, text_batch):
    prompts, drafter = prompts_of(text_batch), make_drafter(llama_target)
    with pytest.raises(UserError, match="drafting.mode=tree decodes one prompt at a time") as error:
        generate_batch(llama_target, drafter, prompts, 8, k=3, drafting=DraftingConfig(mode="tree"))
    assert "\n" not in str(error.value) and "drafting.mode=chain" in str(error.value)
    with pytest.raises(UserError, match="batch_size=2 needs drafting.mode=chain") as error:
        report.InferenceConfig(drafter="x", batch_size=2, drafting=DraftingConfig(mode="tree"))
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="batch_size=1"):
        make_batch_proposer(SimpleNamespace(drafting_kind="parallel"), 3, 8, 16, torch.zeros(2, dtype=torch.long))
    # One prompt is generate itself, tree drafts included.
    tree = DraftingConfig(mode="tree")
    one = generate_batch(llama_target, drafter, prompts[:1], 12, k=3, drafting=tree)
    assert one.tokens == [generate(llama_target, drafter, prompts[0], 12, k=3, drafting=tree).tokens]


# --- 5. the report -----------------------------------------------------------------------------------


def test_report_groups_prompts_by_batch_size_and_keeps_its_shape(llama_target, make_drafter):
    texts = ["def f(x):\n    return", "import json\n", "class A:\n    def __init__(self):\n"]
    drafter = make_drafter(llama_target)
    prompts = evalsets.prompts_of([[text] for text in texts], None, llama_target, 10)
    reports = [report.measure(llama_target, drafter, prompts, report.InferenceConfig(
        drafter="x", max_new_tokens=10, k=3, batch_size=size)) for size in (1, 2)]
    one, two = reports
    assert one.keys() == two.keys() and two["config"]["batch_size"] == 2
    assert [r["prompt"] for r in two["prompts"]] == texts
    assert [r["output_ids"] for r in two["prompts"]] == [r["output_ids"] for r in one["prompts"]]
    assert two["outputs_match_baseline"] is one["outputs_match_baseline"] is True
    assert one["acceptance_length"] == two["acceptance_length"]  # each row accepts what it accepts alone
    assert two["num_drafts"] > 0 and two["target_forwards"] < one["target_forwards"]
