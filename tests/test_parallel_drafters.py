"""What serving asks of the one-pass drafters, P-EAGLE (tests/test_peagle.py) and DFlash
(tests/test_dflash.py), through inference/drafting.py ParallelProposer: greedy output equal to the
target's, random and taught, at K = 1 and the most drafts a pass gives; sampled drafts that carry
their distribution q over the target vocabulary, with the drafter's cache holding the context only."""

import pytest
import torch
from conftest import VOCAB_SIZE
from test_dflash import B, make_dflash
from test_peagle import K, make_peagle, teach_target_continuation

from inference.drafting import ParallelProposer
from inference.engine import generate

FAMILIES = {"peagle": (make_peagle, K), "dflash": (make_dflash, B - 1)}  # factory, most drafts a pass


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("most", [False, True])
def test_engine_greedy_output_is_the_targets(target, text_batch, family, most):
    make, k = FAMILIES[family][0], FAMILIES[family][1] if most else 1
    prompts = [text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist()]
    random = make(target, text_batch).eval()
    taught = make(target, text_batch)
    teach_target_continuation(target, taught, prompts[0])
    accepted = 0
    for drafter in (random, taught):
        for prompt in prompts:
            alone = generate(target, None, prompt, 40, 0)
            spec = generate(target, drafter, prompt, 40, k)
            assert spec.tokens == alone.tokens
            assert spec.stats.num_draft_tokens == k * spec.stats.num_drafts
            accepted += spec.stats.num_accepted_tokens
    assert accepted > 0  # the accept path (several tokens per verification) ran


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_drafts_carry_their_distributions(llama_target, text_batch, family):
    make, k = FAMILIES[family]
    drafter = make(llama_target, text_batch).eval()
    prompt = text_batch[0, :12].tolist()
    proposer = ParallelProposer(drafter, k, VOCAB_SIZE, 64, None)
    proposer.prefill(prompt, 7, llama_target(torch.tensor([prompt])))
    draft = proposer.propose(1.0, torch.Generator().manual_seed(0))
    assert draft.is_chain and len(draft.tokens) == k and draft.probs.shape == (k, VOCAB_SIZE)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(k))
    assert (draft.probs[:, ~drafter.t2d] == 0).all()
    assert all(draft.probs[i, token] > 0 for i, token in enumerate(draft.tokens))
    assert proposer.cache.length == len(prompt)  # prompt[1:] + the first token: the drafts are never kept
    sampled = generate(llama_target, drafter, prompt, 30, k, temperature=1.0, seed=1)
    assert 0 < len(sampled.tokens) <= 30
