"""The static fast path computes exactly what transformers computes, through prefill, decode and rollback; a
prompt's prefill computes the logits of its last position alone (logits="last"), in both sessions and
FrozenTarget: the same next token, the same features."""

import warnings

import pytest
import torch
from conftest import LAYER_IDS

from inference.sessions import HFSession, StaticSession, open_session


def test_static_session_matches_transformers(target):
    tokens = torch.randint(0, target.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    static, hf = StaticSession(target, 64), HFSession(target)
    for step in (tokens[:, :30], tokens[:, 30:36], None, tokens[:, 33:34], tokens[:, 34:40]):
        if step is None:  # reject the last 3 positions, as after a partly accepted draft
            static.crop(33)
            hf.crop(33)
            continue
        with warnings.catch_warnings():  # transformers' own cache argument, not its deprecated name
            warnings.simplefilter("error", FutureWarning)
            a, b = static(step), hf(step)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.last_hidden, b.last_hidden, atol=1e-5, rtol=1e-5)
        for x, y in zip(a.aux_hidden, b.aux_hidden, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert static.length == hf.length == 40


def test_open_session_picks_the_static_path_for_llama_family(target):
    assert isinstance(open_session(target, 16), StaticSession)


def test_stacked_projections_follow_weights_that_move(target_dirs):
    """The session stacks Q, K, V and gate, up once per layer (inference.sessions.layer_stacks); weights
    given new storage afterwards (a dtype change, a new value) are stacked again, never served stale."""
    from speculators.target import FrozenTarget, TargetConfig

    target = FrozenTarget.load(TargetConfig(name_or_path=str(target_dirs["llama"]), layer_ids=LAYER_IDS))
    tokens = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    StaticSession(target, 16)(tokens)
    for layer in target.model.model.layers:
        layer.self_attn.k_proj.weight.data = layer.self_attn.k_proj.weight.data * 2
        layer.mlp.up_proj.weight.data = -layer.mlp.up_proj.weight.data
    torch.testing.assert_close(StaticSession(target, 16)(tokens).logits, HFSession(target)(tokens).logits,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("session_class", [StaticSession, HFSession])
def test_prefill_computes_the_last_positions_logits_alone(session_class, llama_target, text_batch):
    prompt = text_batch[:1, :40]
    opened = (lambda: session_class(llama_target, 64)) if session_class is StaticSession else (
        lambda: session_class(llama_target))
    everything, last = opened()(prompt), opened()(prompt, logits="last")
    assert last.logits.shape == (1, 1, llama_target.vocab_size)
    torch.testing.assert_close(last.logits, everything.logits[:, -1:], rtol=1e-5, atol=1e-5)
    assert last.logits.argmax() == everything.logits[0, -1].argmax()
    for whole, alone in zip([*everything.aux_hidden, everything.last_hidden], [*last.aux_hidden, last.last_hidden]):
        assert torch.equal(whole, alone)


def test_frozen_target_names_the_logits_it_returns(llama_target, text_batch):
    ids = text_batch[:, :16]
    assert llama_target(ids, logits="last").logits.shape == (2, 1, llama_target.vocab_size)
    assert llama_target(ids, logits="none").logits is None
    with pytest.raises(ValueError, match="logits='first'"):
        llama_target(ids, logits="first")
