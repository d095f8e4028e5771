"""N-gram lookup in front of a drafter (inference/lookup.py LookupProposer): what it proposes, that
greedy output stays the target's and sampling stays lossless, and that the drafter's cache stays whole."""

import pytest
import torch
from test_engine import MAX_NEW, capture_caches, prompts_of
from test_sampling import check_two_token_law, tiny_target

from common.config import UserError
from inference.draft import Draft
from inference.drafting import DraftingConfig
from inference.engine import generate, generate_batch
from inference.lookup import LookupProposer
from inference.planning import Calibration, Planner, StepCosts, machine
from inference.report import InferenceConfig, table
from speculators.eagle3 import Eagle3Config, Eagle3Drafter


class Recorder:
    """Stands in for the drafter's proposer: records what it reads, always proposes [99]."""

    def __init__(self):
        self.read = []

    def prefill(self, prompt, token, target_out):
        self.read += prompt + [token]

    def accept(self, new_tokens, target_out):
        self.read += new_tokens

    def propose(self, temperature, generator):
        return Draft.chain([99])


def test_lookup_proposes_what_followed_the_latest_occurrence_else_the_drafter():
    drafter = Recorder()
    lookup = LookupProposer(drafter, 3, 100, DraftingConfig(prompt_lookup_max=3, prompt_lookup_min=2))
    lookup.prefill([1, 2, 3, 4, 1, 2], 3, None)  # context 1 2 3 4 1 2 3: "1 2 3" occurred before
    draft = lookup.propose(0.0, None)
    assert (draft.tokens, draft.looked_up, draft.is_chain) == ([4, 1, 2], True, True)

    lookup.accept([5], None)  # ... 3 5: neither "2 3 5" nor "3 5" occurred: the drafter proposes
    draft = lookup.propose(0.0, None)
    assert (draft.tokens, draft.looked_up) == ([99], False)

    lookup.accept([1, 2], None)  # ... 5 1 2: "1 2" occurred twice; the latest was followed by 3 5 1
    draft = lookup.propose(1.0, None)
    assert draft.tokens == [3, 5, 1] and draft.looked_up
    assert torch.equal(draft.probs, torch.eye(100)[[3, 5, 1]])  # q of a lookup: certain of its token
    assert drafter.read == [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]  # the drafter read every accepted position


def test_lookup_chain_length_is_its_own():
    lookup = LookupProposer(Recorder(), 1, 100, DraftingConfig(prompt_lookup_max=2, prompt_lookup_tokens=4))
    lookup.prefill([7, 8, 1, 2, 3, 4, 5, 7], 8, None)
    assert lookup.propose(0.0, None).tokens == [1, 2, 3, 4]


def test_a_planned_lookup_chain_reads_its_own_counts_and_costs_no_drafter_time():
    """The drafter's calibration (here: every draft hopeless) and its per-draft cost (50 ms, five target
    steps) are the drafter's: a lookup chain that survived 9 times in 10 is verified whole."""
    planner = Planner(StepCosts([10, 11, 12, 13, 14, 15], 16, "t", machine()), per_pass=False,
                      calibration=Calibration([1.0], [-10.0]))
    planner.record_draft(0.050, 1)
    assert planner.best_length([0.9] * 5) == 0 and planner.best_length([0.9] * 5, looked_up=True) == 5
    lookup = LookupProposer(Recorder(), 1, 100, DraftingConfig(prompt_lookup_max=2, prompt_lookup_tokens=5, plan=True))
    lookup.planner = planner
    lookup.prefill([7, 8, 1, 2, 3, 4, 5, 7], 8, None)
    lookup.reached, lookup.survived = [10] * 5, [9] * 5
    draft = lookup.propose(0.0, None)
    assert draft.tokens == [1, 2, 3, 4, 5] and draft.estimates[0] == pytest.approx(10 / 12)
    lookup.survived = [1] * 5  # a chain that rarely survives past its first draft: one is verified
    assert lookup.propose(0.0, None).tokens == [1]
    lookup.reached, lookup.survived = [40, 36, 32, 0, 0], [36, 32, 29, 0, 0]  # never verified past 3: 4 and 5
    assert lookup.survival_rates(5)[3] == lookup.survival_rates(5)[2] > 0.85  # start where position 3 stands
    assert lookup.propose(0.0, None).tokens == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_with_lookup_matches_target_only_and_keeps_the_drafter_cache_whole(
        target, make_drafter, text_batch, mode, monkeypatch):
    drafter = make_drafter(target)
    caches = capture_caches(drafter, monkeypatch)
    drafting = DraftingConfig(mode, prompt_lookup_max=2, prompt_lookup_min=1, prompt_lookup_tokens=4)
    for prompt in prompts_of(text_batch):
        base = generate(target, None, prompt, MAX_NEW, k=0)
        spec = generate(target, drafter, prompt, MAX_NEW, k=2, drafting=drafting)
        assert spec.tokens == base.tokens
        stats = spec.stats
        assert 0 < stats.lookup_drafts <= stats.num_drafts
        assert stats.lookup_accepted_tokens <= stats.num_accepted_tokens
        assert len(stats.accepted_at) == 4 and sum(stats.accepted_at) == stats.num_accepted_tokens
        verified = len(prompt) + stats.num_drafts + stats.num_accepted_tokens  # prompt, first token, then each pass
        assert caches[-1].length == verified


def test_sampling_with_lookup_stays_lossless():
    """The two-token law of test_engine, from a prompt that repeats itself, so lookups are drafted often
    (and rejected often: their q is a point mass) beside the drafter's chains."""
    target = tiny_target(8)
    torch.manual_seed(2)
    drafter = Eagle3Drafter.from_target(Eagle3Config(draft_vocab_size=6), target, torch.arange(8, 0, -1))
    drafting = DraftingConfig(prompt_lookup_max=2, prompt_lookup_min=1)
    stats = check_two_token_law(target, drafter, prompt=(1, 5, 2, 7, 1, 5), drafting=drafting)
    assert 0.2 * stats.num_drafts < stats.lookup_drafts < 0.9 * stats.num_drafts


def test_report_says_how_the_drafts_split():
    figures = {"acceptance_rate_per_position": [0.5], "acceptance_length": 2.0, "num_drafts": 10, "lookup_drafts": 4,
               "lookup_accepted_tokens": 8, "num_accepted_tokens": 10, "per_turn": None, "tokens_per_second": 2.0,
               "baseline_tokens_per_second": 1.0, "speedup": 2.0, "time_split_s": {}, "outputs_match_baseline": True,
               "config": {"drafting": {"chain_min_prob": 0.0}}}
    assert "n-gram lookup drafted 4 of 10 (40%), tau there 3.000; the drafter's tau 1.333" in table(figures)


def test_bad_lookup_settings_are_one_line_errors(target, make_drafter, text_batch):
    with pytest.raises(UserError, match="prompt_lookup_max"):
        DraftingConfig(prompt_lookup_max=1, prompt_lookup_min=2)
    with pytest.raises(UserError, match="n-gram lookup drafts one prompt at a time"):
        InferenceConfig(drafter="unused", batch_size=2, drafting=DraftingConfig(prompt_lookup_max=2))
    with pytest.raises(UserError, match="batch_size=1"):
        generate_batch(target, make_drafter(target), prompts_of(text_batch), 4, k=2,
                       drafting=DraftingConfig(prompt_lookup_max=2))


def test_drafters_that_read_when_they_draft_stay_whole_behind_lookup(target, text_batch, monkeypatch):
    """P-EAGLE reads verified positions when it drafts, the self-draft copy keeps its own drafts: after
    a cycle a lookup drafted, both must still read everything. A copy equal to the target accepts
    every draft only if its cache follows the verified sequence."""
    from test_peagle import make_peagle

    from speculators.self_draft import SelfDrafter

    drafting = DraftingConfig(prompt_lookup_max=2, prompt_lookup_min=1)
    copy = SelfDrafter(target, "int8", 3)
    for prompt in prompts_of(text_batch):
        base = generate(target, None, prompt, MAX_NEW, k=0).tokens
        spec = generate(target, copy, prompt, MAX_NEW, k=3, drafting=drafting)
        assert spec.tokens == base and spec.stats.lookup_drafts > 0
        own = spec.stats.num_drafts - spec.stats.lookup_drafts
        assert spec.stats.num_accepted_tokens - spec.stats.lookup_accepted_tokens >= 0.9 * 3 * own
        peagle, read = make_peagle(target, text_batch).eval(), []
        draft = peagle.draft

        def reading(cache, tokens, features, k):  # P-EAGLE's cache slot s holds token s+1
            assert cache.length == len(read)
            read.extend(tokens[0].tolist())
            return draft(cache, tokens, features, k)

        monkeypatch.setattr(peagle, "draft", reading)
        spec = generate(target, peagle, prompt, MAX_NEW, k=3, drafting=drafting)
        assert spec.tokens == base and spec.stats.lookup_drafts > 0
        assert read == (prompt + base)[1 : 1 + len(read)] and len(read) > len(prompt)
