"""The speculative-decoding engine (inference/engine.py) and the drafter's serving path.

1. Greedy speculation is lossless: token for token the target's own greedy output, with a random
   drafter (nothing accepted) and with an oracle drafter that is right except at chosen positions
   (partial acceptance, so both KV caches are rolled back), and the counters follow vLLM's definitions.
2. Sampling is lossless: tests/test_sampling.py.
3. Bad input: a drafter built for another target, decoding without a drafter, prompts too long.
4. Serving computes what training trains: Eagle3Drafter.step over a prefix and along a draft chain
   equals the training-time-test unroll of training_loss.

Indexing used throughout (engine.generate and the eagle3 docstring): the drafter's cache index s
holds the target's features of sequence position s and the token at s+1; its logits there predict
the token at s+2. A verified prefix of n sequence tokens fills cache indices 0..n-2; draft i of a
round (i = 0..k-1) comes from cache index n-2+i and proposes sequence token n+i.
"""

import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import DRAFT_VOCAB, LAYER_IDS, make_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import UserError
from inference import engine
from inference.drafting import DraftingConfig
from inference.engine import check_pair, generate
from inference.sessions import HFSession, open_session
from speculators.layers import shift_left
from speculators.target import FrozenTarget

MAX_NEW = 40


# --- helpers ------------------------------------------------------------------------------------


def prompts_of(text_batch) -> list[list[int]]:
    return [text_batch[0, :12].tolist(), text_batch[1, 7:22].tolist()]


def check_stats(stats, k: int, emitted: int) -> None:
    """vLLM's counters: one draft = one verification step; accepted_at[i] = drafts whose token i+1 was accepted."""
    assert stats.k == k and len(stats.accepted_at) == k
    assert stats.num_draft_tokens == k * stats.num_drafts
    assert all(a >= b for a, b in zip(stats.accepted_at, stats.accepted_at[1:])), stats.accepted_at
    assert stats.accepted_at[0] <= stats.num_drafts
    assert sum(stats.accepted_at) == stats.num_accepted_tokens
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.target_forwards == stats.num_drafts + 1  # the prefill, then one pass per draft
    # Every verification emits its accepted drafts plus one token; the prefill emits the first.
    assert emitted <= 1 + stats.num_drafts + stats.num_accepted_tokens


def capture_caches(drafter, monkeypatch) -> list:
    """Keep every cache generate() asks the drafter for, to inspect it after generation."""
    caches, new_cache = [], drafter.new_cache

    def recording(*args, **kwargs):
        caches.append(new_cache(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(drafter, "new_cache", recording)
    return caches


def fused_features(target, seq: list[int]) -> torch.Tensor:
    """The target's aux features of every position of `seq`, concatenated: [len(seq), n_aux * H]."""
    return torch.cat(target(torch.tensor([seq])).aux_hidden, dim=-1)[0]


# --- 1. greedy speculation is lossless ----------------------------------------------------------


@pytest.fixture(params=["static", "hf"])
def session(request, monkeypatch):
    """Decode the target through its static session (the default for Llama and Qwen3) or through
    transformers with a DynamicCache (the path of every other architecture)."""
    if request.param == "hf":
        monkeypatch.setattr(engine, "open_session", lambda target, max_len: HFSession(target))
    return request.param


class OracleCache:
    """The drafter cache's interface (length, crop) over what the engine fed to each cache index."""

    def __init__(self, max_len: int):
        self.length = 0
        self.tokens = torch.full((max_len,), -1, dtype=torch.long)
        self.hidden: list = [None] * max_len

    def append(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        end = self.length + tokens.shape[1]
        if end > len(self.tokens):
            raise ValueError(f"oracle cache of {len(self.tokens)} positions is full")
        self.tokens[self.length:end] = tokens[0]
        for i in range(tokens.shape[1]):
            self.hidden[self.length + i] = hidden[0, i]
        self.length = end

    def crop(self, length: int) -> None:
        self.length = length


class OracleDrafter:
    """A fake drafter that knows the target's greedy continuation `seq` (prompt + output).

    At cache index s it proposes seq[s + 2] (the token the real drafter there is trained to predict),
    except where `wrong(s)`, where it proposes another token, which greedy verification must reject.
    Full target vocabulary as its draft vocabulary; its "hidden" is the fused features, passed through.
    """

    drafting_kind = "autoregressive"  # served as EAGLE drafters are (speculators/drafter.py's contract)

    def __init__(self, target, seq: list[int], wrong):
        H, V = target.hidden_size, target.vocab_size
        self.seq, self.wrong, self.vocab_size = seq, wrong, V
        self.layer_ids = list(target.layer_ids)
        self.target_hidden_size = H  # read by check_pair
        self.lm_head = nn.Linear(H, V, bias=False)
        self.d2t = torch.zeros(V, dtype=torch.long)
        self.t2d = torch.ones(V, dtype=torch.bool)
        self.caches: list[OracleCache] = []

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.vocab_size) + self.d2t

    def new_cache(self, batch: int, max_len: int, device=None) -> OracleCache:
        assert batch == 1
        self.caches.append(OracleCache(max_len))
        return self.caches[-1]

    def features(self, target_out) -> torch.Tensor:
        return torch.cat(target_out.aux_hidden, dim=-1)

    def proposal(self, s: int) -> int:
        right = self.seq[s + 2] if s + 2 < len(self.seq) else 0
        return (right + 1) % self.vocab_size if self.wrong(s) else right

    def step(self, cache: OracleCache, tokens: torch.Tensor, hidden: torch.Tensor):
        assert tokens.shape[0] == 1 and hidden.shape[:2] == tokens.shape, (tokens.shape, hidden.shape)
        start, m = cache.length, tokens.shape[1]
        cache.append(tokens, hidden)
        logits = torch.zeros(1, m, self.vocab_size)
        for i in range(m):
            logits[0, i, self.proposal(start + i)] = 10.0
        return logits, hidden


def wrong_positions(s: int) -> bool:
    """Deterministic misses at irregular gaps (1, 3, 4, 6), so rounds end early at various draft
    positions, some reject their first draft and some accept all k (checked below, k = 3 and 5)."""
    return s % 14 in (0, 1, 4, 8)


def predicted_rounds(prompt_len: int, k: int, max_new: int, wrong) -> list[int]:
    """Accepted count of every verification step with the oracle, from the indexing in the module docstring."""
    n, emitted, rounds = prompt_len + 1, 1, []  # after the prefill: prompt + one token verified
    while emitted < max_new:
        first_wrong = [i for i in range(k) if wrong(n - 2 + i)]
        accepted = first_wrong[0] if first_wrong else k
        rounds.append(accepted)
        n, emitted = n + accepted + 1, emitted + accepted + 1
    return rounds


@pytest.mark.parametrize("k", [3, 5])
def test_greedy_random_drafter_matches_target_only(target, make_drafter, text_batch, k, session, monkeypatch):
    drafter = make_drafter(target)
    caches = capture_caches(drafter, monkeypatch)
    for prompt in prompts_of(text_batch):
        base = generate(target, None, prompt, MAX_NEW, k=0)
        longer = generate(target, None, prompt, MAX_NEW + k + 1, k=0).tokens  # what speculation overshoots into
        assert len(base.tokens) == MAX_NEW and longer[:MAX_NEW] == base.tokens
        spec = generate(target, drafter, prompt, MAX_NEW, k=k)
        assert spec.tokens == base.tokens
        check_stats(spec.stats, k, len(spec.tokens))
        # After the last round the drafter's cache holds exactly the verified positions (rejected chain
        # entries rolled back), with the keys a fresh pass over the verified sequence computes.
        cache = caches[-1]
        emitted = 1 + spec.stats.num_drafts + spec.stats.num_accepted_tokens
        seq = prompt + longer[:emitted]
        assert cache.length == len(seq) - 1
        fresh = drafter.new_cache(1, len(seq))
        drafter.step(fresh, torch.tensor([seq[1:]]), drafter.fuse(target(torch.tensor([seq[:-1]])).aux_hidden))
        torch.testing.assert_close(cache.k[:, :, : cache.length], fresh.k[:, :, : fresh.length], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache.v[:, :, : cache.length], fresh.v[:, :, : fresh.length], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [3, 5])
def test_greedy_oracle_drafter_partial_acceptance_matches_target_only(target, text_batch, k, session):
    for prompt in prompts_of(text_batch):
        base = generate(target, None, prompt, MAX_NEW, k=0)
        seq = prompt + generate(target, None, prompt, MAX_NEW + k + 2, k=0).tokens
        assert seq[len(prompt):][:MAX_NEW] == base.tokens

        # Never wrong: every draft of every round is accepted. This pins down the indexing.
        perfect = OracleDrafter(target, seq, wrong=lambda s: False)
        spec = generate(target, perfect, prompt, MAX_NEW, k=k)
        assert spec.tokens == base.tokens
        check_stats(spec.stats, k, len(spec.tokens))
        assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens > 0
        assert spec.stats.num_drafts == math.ceil((MAX_NEW - 1) / (k + 1))

        # Wrong at chosen positions: rounds end early, both caches are rolled back past the rejected drafts.
        oracle = OracleDrafter(target, seq, wrong=wrong_positions)
        spec = generate(target, oracle, prompt, MAX_NEW, k=k)
        assert spec.tokens == base.tokens
        stats = spec.stats
        check_stats(stats, k, len(spec.tokens))
        rounds = predicted_rounds(len(prompt), k, MAX_NEW, wrong_positions)
        assert stats.num_drafts == len(rounds)
        assert stats.num_accepted_tokens == sum(rounds) > 0
        assert stats.accepted_at == [sum(a > i for a in rounds) for i in range(k)]
        partial = stats.accepted_at[0] - stats.accepted_at[-1]  # drafts with 1..k-1 tokens accepted
        assert partial > 0 and stats.num_drafts - stats.accepted_at[0] > 0  # and some with none accepted
        assert stats.accepted_at[-1] > 0  # and some with all k accepted

        # The drafter's cache ends with the verified sequence only: at index s the token at s+1 and the
        # target's features of position s (rejected chain entries were overwritten, not left behind).
        cache = oracle.caches[-1]
        n = cache.length
        assert n == len(prompt) + stats.num_drafts + stats.num_accepted_tokens
        assert cache.tokens[:n].tolist() == seq[1 : n + 1]
        torch.testing.assert_close(torch.stack(cache.hidden[:n]), fused_features(target, seq[:n]), atol=1e-4, rtol=1e-4)


def test_greedy_oracle_drafter_with_eos_inside_accepted_drafts(llama_target, text_batch):
    """EOS accepted in the middle of a draft chain: the output still stops right after it."""
    prompt, k = prompts_of(text_batch)[0], 5
    seq = prompt + generate(llama_target, None, prompt, MAX_NEW + k + 2, k=0).tokens
    for eos_at in (4, 9, 13):  # cuts that fall at different offsets inside the rounds
        eos = seq[len(prompt) + eos_at]
        with_eos = FrozenTarget(llama_target.model, SimpleNamespace(eos_token_id=eos), "eos", LAYER_IDS)
        base = generate(with_eos, None, prompt, MAX_NEW, k=0)
        assert base.tokens[-1] == eos and len(base.tokens) <= eos_at + 1
        for wrong in (lambda s: False, wrong_positions):
            spec = generate(with_eos, OracleDrafter(with_eos, seq, wrong), prompt, MAX_NEW, k=k)
            assert spec.tokens == base.tokens


def test_low_precision_target_decodes_with_a_float32_drafter(tokenizer, make_drafter, text_batch):
    """TargetConfig allows bfloat16 targets; drafters are float32 (from_target copies with .float()).
    TargetOutput features are float32 whatever the target's dtype (FrozenTarget.__call__ casts them),
    so the drafter can fuse them: the session generate() decodes through must keep that contract."""
    target = FrozenTarget(make_model("llama", tokenizer).to(torch.bfloat16), tokenizer, "bf16", LAYER_IDS)
    drafter = make_drafter(target)
    prompt = prompts_of(text_batch)[0]
    spec = generate(target, drafter, prompt, 16, k=3)
    assert len(spec.tokens) == 16
    check_stats(spec.stats, 3, len(spec.tokens))
    out = open_session(target, 32)(torch.tensor([prompt]))
    reference = target(torch.tensor([prompt]))
    assert [h.dtype for h in out.aux_hidden] == [h.dtype for h in reference.aux_hidden] == [torch.float32] * 3
    assert out.last_hidden.dtype == reference.last_hidden.dtype == torch.float32


# --- 3. bad input -------------------------------------------------------------------------------


def other_target(hidden: int = 32, vocab: int = 320, layers: int = 4, layer_ids=LAYER_IDS) -> FrozenTarget:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return FrozenTarget(LlamaForCausalLM(config), SimpleNamespace(eos_token_id=0), "other", layer_ids)


def test_check_pair_accepts_the_drafter_of_the_target(target, make_drafter):
    check_pair(target, make_drafter(target))


@pytest.mark.parametrize("field, other, mine, theirs", [
    ("hidden size", dict(hidden=48), 48, 32),
    ("vocabulary size", dict(vocab=300), 300, 320),
    ("feature layer ids", dict(layers=8, layer_ids=[0, 3, 5]), "[0, 3, 5]", "4 layers"),
])
def test_check_pair_refuses_a_drafter_of_another_target(llama_target, make_drafter, field, other, mine, theirs):
    drafter = make_drafter(other_target(**other))
    with pytest.raises(UserError, match=re.escape(field)) as error:
        check_pair(llama_target, drafter)
    assert str(mine) in str(error.value) and str(theirs) in str(error.value), str(error.value)


def test_check_pair_refuses_a_d2t_of_the_wrong_length(llama_target, make_drafter):
    drafter = make_drafter(llama_target)
    drafter.d2t = drafter.d2t[:-1]  # an export that lost a row
    with pytest.raises(UserError, match="d2t") as error:
        check_pair(llama_target, drafter)
    assert str(DRAFT_VOCAB - 1) in str(error.value) and str(DRAFT_VOCAB) in str(error.value), str(error.value)


def test_k0_decodes_without_a_drafter(target, make_drafter, text_batch, session):
    prompt = prompts_of(text_batch)[0]
    out = generate(target, None, prompt, 12, k=0)
    # Independent reference: greedy argmax of a full (cache-free) forward over the growing sequence.
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(target.model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out.tokens == seq[len(prompt):]
    assert out.stats.num_drafts == 0 and out.stats.accepted_at == [] and out.stats.target_forwards == 12
    # No drafter: k is ignored, plain decoding. A drafter with k=0 is not used.
    assert generate(target, None, prompt, 12, k=5).tokens == out.tokens
    with_drafter = generate(target, make_drafter(target), prompt, 12, k=0)
    assert with_drafter.tokens == out.tokens and with_drafter.stats.num_drafts == 0


def test_prompt_longer_than_the_context_is_a_user_error(llama_target, make_drafter):
    limit = llama_target.config.max_position_embeddings
    drafter = make_drafter(llama_target)
    with pytest.raises(UserError, match=str(limit)):
        generate(llama_target, None, [5] * (limit + 1), 4, k=0)
    with pytest.raises(UserError, match=str(limit)):
        generate(llama_target, drafter, [5] * (limit + 1), 4, k=3)
    # Fits alone, not with the tokens to generate and the drafts.
    with pytest.raises(UserError, match=str(limit)):
        generate(llama_target, drafter, [5] * (limit - 10), 8, k=3)
    # Right at the limit it decodes (the drafter's preallocated cache is large enough).
    prompt = list(range(1, limit - 8 - 3 - 1 + 1))
    assert generate(llama_target, drafter, prompt, 8, k=3).tokens == generate(llama_target, None, prompt, 8, k=0).tokens


# --- 4. serving computes what training trains ---------------------------------------------------


@pytest.mark.parametrize("fields", [{}, {"norm_before_residual": True}, {"fc_norm": True, "norm_output": True},
                                    {"norm_before_fc": True, "norm_output": True}])  # the last two: EAGLE-3.1
def test_step_equals_the_training_time_test_unroll(target, make_drafter, text_batch, fields):
    steps_n, T = 4, 32
    drafter = make_drafter(target, depth=steps_n, **fields)
    ids = text_batch[:, :T]
    B = ids.shape[0]
    out = target(ids)

    # The logits of every TTT step, as training_loss itself computes them.
    ttt = []
    handle = drafter.lm_head.register_forward_hook(lambda _m, _i, o: ttt.append(o.detach()))
    with torch.no_grad():
        drafter.training_loss(out, ids, torch.ones_like(ids))
    handle.remove()
    assert len(ttt) == steps_n
    # Training sends only counted positions through the lm_head: step j's are t < T - 2 - j, row-major.
    ttt = [logits.view(B, T - 2 - j, -1) for j, logits in enumerate(ttt)]

    # Step 0 = serving over a whole prefix: at position t the token t+1 and the features of t.
    fused = drafter.fuse(out.aux_hidden)
    cache = drafter.new_cache(B, T + steps_n)
    logits0, hidden0 = drafter.step(cache, shift_left(ids, 1), fused)
    torch.testing.assert_close(logits0[:, : T - 2], ttt[0], atol=1e-5, rtol=1e-5)

    # The same prefix fed in pieces (prefill, then accepted runs), as the engine does, gives the same.
    pieces = drafter.new_cache(B, T)
    got, start = [], 0
    for size in (7, 1, 3, 1, 1, 5, 2, 12):
        got.append(drafter.step(pieces, shift_left(ids, 1)[:, start:start + size], fused[:, start:start + size])[0])
        start += size
    assert start == T
    torch.testing.assert_close(torch.cat(got, 1)[:, : T - 2], ttt[0], atol=1e-5, rtol=1e-5)

    # Step j at position t = a chain of j steps after the context 0..t, fed the teacher-forced tokens
    # t+2..t+1+j and the drafter's own previous hidden output; rotary position t+j.
    # (A fresh cache per t: a chain overwrites the cache entries after t, which the next t needs.)
    for t in range(T - 1 - steps_n):
        cache = drafter.new_cache(B, t + steps_n)
        _, hidden = drafter.step(cache, shift_left(ids, 1)[:, : t + 1], fused[:, : t + 1])
        torch.testing.assert_close(hidden[:, -1], hidden0[:, t], atol=1e-5, rtol=1e-5)
        for j in range(1, steps_n):
            logits, hidden = drafter.step(cache, ids[:, t + 1 + j : t + 2 + j], hidden[:, -1:])
            torch.testing.assert_close(logits[:, 0], ttt[j][:, t], atol=1e-5, rtol=1e-5)
        # Not vacuous: later steps do differ from step 0 at the same position.
        assert not torch.allclose(ttt[steps_n - 1][:, t], ttt[0][:, t], atol=1e-3)


def test_typical_acceptance_is_off_by_default_and_relaxes_only_when_asked(llama_target, make_drafter, text_batch):
    """tolerance 0 (the default) is exactly target-only greedy decoding; a large tolerance accepts at least
    as much and may change the output; sampling, trees and batches refuse it with one line."""
    drafter = make_drafter(llama_target).eval()
    prompt = text_batch[0, :12].tolist()
    alone = generate(llama_target, None, prompt, 40, 0)
    exact = generate(llama_target, drafter, prompt, 40, 4)
    assert generate(llama_target, drafter, prompt, 40, 4, tolerance=0.0).tokens == exact.tokens == alone.tokens
    relaxed = generate(llama_target, drafter, prompt, 40, 4, tolerance=0.99)
    assert relaxed.stats.acceptance_length >= exact.stats.acceptance_length
    assert relaxed.stats.acceptance_length > 1
    with pytest.raises(UserError, match="acceptance_tolerance=0.5 relaxes greedy chains"):
        generate(llama_target, drafter, prompt, 10, 4, temperature=1.0, tolerance=0.5)
    with pytest.raises(UserError, match="use batch_size=1"):
        engine.generate_batch(llama_target, drafter, [prompt, prompt], 10, 4, tolerance=0.5)


def test_chains_stop_where_the_drafter_is_unsure(llama_target, make_drafter, text_batch, monkeypatch):
    """drafting.chain_min_prob: a chain stops before a draft whose drafter top probability is below it (never
    before the first); 0 is the fixed chain of K; greedy output stays target-only's at every threshold."""
    drafter = make_drafter(llama_target).eval()
    prompt, k = text_batch[0, :12].tolist(), 4
    tops = []  # the drafter's top probability at every step (its reads of accepted positions too)
    step = drafter.step

    def recording_step(cache, tokens, hidden, **kw):
        logits, out = step(cache, tokens, hidden, **kw)
        tops.append(float(torch.softmax(logits[0, -1], -1).max()))
        return logits, out

    alone = generate(llama_target, None, prompt, 40, 0).tokens
    fixed = generate(llama_target, drafter, prompt, 40, k)
    monkeypatch.setattr(drafter, "step", recording_step)
    generate(llama_target, drafter, prompt, 40, k, drafting=DraftingConfig(chain_min_prob=0.0))
    middle = sorted(tops)[len(tops) // 2]  # half the later steps fall below it
    monkeypatch.undo()
    lengths = {}
    for p in (0.0, middle, 0.999):
        spec = generate(llama_target, drafter, prompt, 40, k, drafting=DraftingConfig(chain_min_prob=p))
        assert spec.tokens == alone
        assert spec.stats.num_drafts <= spec.stats.num_draft_tokens <= k * spec.stats.num_drafts
        lengths[p] = spec.stats.num_draft_tokens / spec.stats.num_drafts
    assert fixed.stats.num_draft_tokens == k * fixed.stats.num_drafts and lengths[0.0] == k
    assert 1 < lengths[middle] < k  # the threshold splits: some chains end early, not all at once
    assert lengths[0.999] == 1  # a random drafter is never that sure: every chain is its first draft


def test_the_report_says_how_long_the_chains_were():
    from inference.report import table

    figures = {"acceptance_rate_per_position": [0.5, 0.2], "acceptance_length": 1.7, "num_drafts": 10,
               "num_draft_tokens": 25, "num_accepted_tokens": 7, "lookup_drafts": 0, "per_turn": None,
               "tokens_per_second": 2.0, "baseline_tokens_per_second": 1.0, "speedup": 2.0, "time_split_s": {},
               "outputs_match_baseline": True, "config": {"drafting": {"chain_min_prob": 0.4}}}
    assert "chains of 2.50 drafts on average" in table(figures)
    figures["config"]["drafting"]["chain_min_prob"] = 0.0
    assert "chains of" not in table(figures)


def test_chain_min_prob_is_refused_where_it_does_not_apply(llama_target, make_drafter, text_batch):
    drafter, prompt = make_drafter(llama_target), text_batch[0, :12].tolist()
    with pytest.raises(UserError, match="drafting.chain_min_prob"):
        DraftingConfig(chain_min_prob=1.0)
    unsure = DraftingConfig(mode="tree", chain_min_prob=0.5)
    with pytest.raises(UserError, match="ends EAGLE chains early") as error:
        generate(llama_target, drafter, prompt, 8, 3, drafting=unsure)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="use batch_size=1"):
        engine.generate_batch(llama_target, drafter, [prompt, prompt], 8, 3, drafting=DraftingConfig(chain_min_prob=0.5))


def test_k_beyond_the_trained_depth_is_served_and_said(llama_target, make_drafter, text_batch, capsys):
    """k above the depth the drafter was trained for: one line says so, decoding goes on
    at that K, and the output is still the target's own."""
    from inference.drafting import serving_k

    drafter = make_drafter(llama_target).eval()  # trained for 3 draft tokens
    assert serving_k(drafter, None) == 3 and capsys.readouterr().out == ""
    assert serving_k(drafter, 5) == 5
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "beyond the 3 draft tokens this drafter was trained for" in said[0]
    prompt = text_batch[0, :12].tolist()
    deeper = engine.generate(llama_target, drafter, prompt, 16, k=5)
    assert deeper.tokens == engine.generate(llama_target, None, prompt, 16, k=0).tokens
    assert deeper.stats.num_draft_tokens == 5 * deeper.stats.num_drafts


def test_one_rule_for_k_the_drafter_s_own_its_measured_best_and_beyond_its_depth(llama_target, make_drafter):
    """No K: the K its export recorded as fastest, else its depth. Above the depth: served where the family
    drafts further (EAGLE chains), refused in one line where it cannot (Medusa's heads)."""
    from inference.drafting import serving_k
    from speculators.medusa import MedusaConfig, MedusaDrafter

    drafter = make_drafter(llama_target)  # depth 3
    assert serving_k(drafter, None) == 3
    drafter.best_k = 2
    assert serving_k(drafter, None) == 2 and serving_k(drafter, 3) == 3
    medusa = MedusaDrafter(MedusaConfig(depth=2), llama_target.hidden_size, llama_target.vocab_size)
    assert serving_k(medusa, None) == 2
    with pytest.raises(UserError, match="k=3: this MedusaDrafter drafts at most 2 tokens"):
        serving_k(medusa, 3)
