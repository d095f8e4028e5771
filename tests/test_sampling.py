"""Sampled speculative decoding is lossless (inference/engine.py): chi-square goodness of fit of the emitted
tokens to the target's distribution, for chain_sampled alone (with a verifier that resamples from p, to show
the test has the power to catch it) and end to end through generate(), also where chains stop early. The
helpers (tiny_target, check_two_token_law, chi_square) serve the other families' and engines' sampling tests.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import LAYER_IDS
from transformers import LlamaConfig, LlamaForCausalLM

from inference.drafting import DraftingConfig
from inference.engine import Stats, chain_sampled, generate
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from speculators.target import FrozenTarget


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below `min_expected` are pooled into one."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = counts.sum() * probs / probs.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if bool(small.any()) and exp[-1] < min_expected and len(exp) > 1:  # the pooled cell itself too small
        obs = torch.cat([obs[:-2], obs[-2:].sum().view(1)])
        exp = torch.cat([exp[:-2], exp[-2:].sum().view(1)])
    assert len(exp) >= 2
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


ALPHA = 0.001  # every goodness-of-fit test below rejects at this level; seeds are fixed, so it is deterministic


def test_chi2_sf_matches_the_table():
    # Table values of the chi-square distribution at alpha = 0.001: df=7 -> 24.322, df=63 -> 103.442.
    assert chi2_sf(24.322, 7) == pytest.approx(0.001, rel=1e-3)
    assert chi2_sf(103.442, 63) == pytest.approx(0.001, rel=1e-3)
    assert chi2_sf(0.0, 5) == pytest.approx(1.0)


# --- rejection sampling emits the target's law ---------------------------------------------------------------------


def buggy_verify_sampling(drafts, draft_probs, target_logits, temperature, generator):
    """The classic mistake, to show the test has power: resample from p instead of norm(max(0, p - q))."""
    p = torch.softmax(target_logits / temperature, -1)
    for i, token in enumerate(drafts):
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[i, token] / draft_probs[i, token])):
            continue
        return i, int(torch.multinomial(p[i], 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def sample_verifications(verify, target_logits, q, temperature, trials, seed=0):
    """Emitted tokens of `trials` verifications of 2 drafts x_i ~ q[i]: first token counts over all
    trials; second token counts over trials whose first draft was accepted."""
    V = q.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(V), torch.zeros(V)
    drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=gen) for i in range(2)], 1)
    for d in drafts.tolist():
        accepted, token = verify(d, q, target_logits, temperature, gen)
        emitted = d[:accepted] + [token]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
    return first, second


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_verify_sampling_emits_the_target_distribution(temperature):
    V, trials = 8, 20_000
    gen = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(3, V, generator=gen) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)
    q[:, :2] = 0  # a reduced draft vocabulary: tokens 0 and 1 come only from the residual
    q /= q.sum(-1, keepdim=True)
    p = torch.softmax(target_logits / temperature, -1)
    acceptance = torch.minimum(p[0], q[0]).sum()
    assert 0.3 < acceptance < 0.9  # both branches (accept, resample) are exercised often

    first, second = sample_verifications(chain_sampled, target_logits, q, temperature, trials)
    for counts, probs in ((first, p[0]), (second, p[1])):
        # df = cells - 1 (7 without pooling); reject at alpha = 0.001.
        stat, df = chi_square(counts, probs)
        assert chi2_sf(stat, df) > ALPHA, (stat, df, counts, probs)
    assert second.sum() > 0.3 * trials

    # The same test rejects a verifier that resamples from p: it has the power to catch that bug.
    first, _ = sample_verifications(buggy_verify_sampling, target_logits, q, temperature, trials)
    stat, df = chi_square(first, p[0])
    assert chi2_sf(stat, df) < ALPHA


def tiny_target(vocab: int = 8, seed: int = 1) -> FrozenTarget:
    """A 3-layer Llama over `vocab` tokens without EOS, so every run emits exactly max_new_tokens."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.3)
    return FrozenTarget(LlamaForCausalLM(config).eval(), SimpleNamespace(eos_token_id=None), "tiny", LAYER_IDS)


def test_generate_samples_the_target_distribution_end_to_end():
    """(x1, x2), the two tokens after the prefill's token x0, over many seeds, against the target's
    own joint law sum_x0 p(x0) p(x1 | x0) p(x2 | x0, x1). x1 is always emitted by the first
    verification (accepted draft 0, or the resample after rejecting it); x2 by the first
    verification (draft 1 accepted, or the resample/bonus after it) or, after a rejection at
    draft 0, by the second one, after both caches were rolled back."""
    target = tiny_target(8)
    torch.manual_seed(2)
    counts = torch.arange(8, 0, -1)  # draft vocabulary: target tokens 0..5; 6 and 7 only via the residual
    check_two_token_law(target, Eagle3Drafter.from_target(Eagle3Config(draft_vocab_size=6), target, counts))


def check_two_token_law(target: FrozenTarget, drafter, k: int = 3, runs: int = 2000, prompt=(1, 5, 2, 7),
                        drafting: DraftingConfig | None = None) -> Stats:
    """Sampled speculative decoding of (x1, x2) after a fixed prompt, over `runs` seeds, passes a
    chi-square test against the target's joint law, with drafts both accepted and rejected often.
    Returns the counters of all runs."""
    V, prompt = target.vocab_size, list(prompt)
    seen = torch.zeros(V, V)
    stats = Stats(k)
    for seed in range(runs):
        g = generate(target, drafter, prompt, 3, k=k, temperature=1.0, seed=seed, drafting=drafting)
        seen[g.tokens[1], g.tokens[2]] += 1
        stats.add(g.stats)
    assert 0.2 < stats.num_accepted_tokens / stats.num_drafts < 0.8 * k  # drafts are both accepted and rejected

    p0 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
    x0 = torch.arange(V)[:, None]
    p1 = torch.softmax(target(torch.cat([torch.tensor([prompt] * V), x0], 1)).logits[:, -1].double(), -1)
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (x0, x1), x0-major
    p2 = torch.softmax(target(torch.cat([torch.tensor([prompt] * V * V), pairs], 1)).logits[:, -1].double(), -1)
    joint = (p0[:, None, None] * p1[:, :, None] * p2.view(V, V, V)).sum(0)  # [x1, x2]
    # 64 cells, those expected below 5 pooled into one: df = cells - 1 (39 here); reject at alpha = 0.001.
    stat, df = chi_square(seen, joint)
    assert chi2_sf(stat, df) > ALPHA, (stat, df)
    return stats


def test_sampled_chains_that_stop_early_stay_lossless():
    """Where a chain stops depends on the drafter's distribution, never on the token drawn from it,
    so rejection sampling still emits the target's law (the two-token test of the fixed chains)."""
    target = tiny_target(8)
    torch.manual_seed(2)
    drafter = Eagle3Drafter.from_target(Eagle3Config(draft_vocab_size=6), target, torch.arange(8, 0, -1))
    stats = check_two_token_law(target, drafter, drafting=DraftingConfig(chain_min_prob=0.3))
    assert stats.num_drafts < stats.num_draft_tokens < 3 * stats.num_drafts  # chains of 1 to 3 drafts
