"""Sequence-level unlikelihood steps of the target's pretraining (train/pretrain.py)."""

import copy

import pytest
import torch

from common.config import UserError
from train.optim import OptimConfig
from train.pretrain import (
    CausalLMModule,
    ModelConfig,
    UnlikelihoodConfig,
    build_model,
    greedy_continuations,
    repeated_ngram_mask,
    train_tokenizer,
    unlikelihood_of_repeats,
)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 20, "import os\nimport sys\n" * 20], vocab_size=300)
    return build_model(ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128), tokenizer)


def test_repeated_ngrams_are_marked_only_after_the_prefix():
    tokens = torch.tensor([[1, 2, 3, 1, 2, 3, 4],    # (1,2) and (2,3) come back: positions 3-5
                           [5, 5, 5, 1, 2, 6, 7]])   # (5,5) repeats, but inside the prefix
    expected = torch.tensor([[0, 0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(repeated_ngram_mask(tokens, n=2, start=3), expected)


def test_a_step_on_the_penalty_lowers_it_and_a_sequence_without_repeats_costs_nothing(tiny):
    looping = torch.tensor([[10, 11, 12, 13] + [20, 21, 22] * 6])
    fresh = torch.arange(30, 52)[None]
    assert unlikelihood_of_repeats(tiny, fresh, prefix_len=4, n=3).item() == 0

    model = copy.deepcopy(tiny)  # the fixture stays untrained for the other tests
    before = unlikelihood_of_repeats(model, looping, prefix_len=4, n=3)
    assert before.item() > 0
    before.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    assert unlikelihood_of_repeats(model, looping, prefix_len=4, n=3).item() < before.item()


def test_greedy_continuations_have_the_asked_length_even_past_eos(tiny):
    eos = tiny.config.eos_token_id
    prefixes = torch.tensor([[eos, 5, 6], [7, 8, eos]])
    out = greedy_continuations(tiny, prefixes, length=12)
    assert out.shape == (2, 15) and torch.equal(out[:, :3], prefixes)


def test_every_nth_step_is_an_unlikelihood_step(tiny, monkeypatch):
    module = CausalLMModule(tiny, OptimConfig(), max_steps=4, byte_lengths=torch.ones(tiny.config.vocab_size),
                            unlikelihood=UnlikelihoodConfig(every_n_steps=2, prefix_len=4, continuation_len=8))
    logged = []
    monkeypatch.setattr(module, "log", lambda name, value, **_: logged.append(name))
    monkeypatch.setattr(CausalLMModule, "global_step", property(lambda self: self.step))
    monkeypatch.setattr(CausalLMModule, "trainer", property(lambda self: type("T", (), {"default_root_dir": "."})))
    batch = {"input_ids": torch.randint(0, tiny.config.vocab_size, (2, 16))}
    for module.step in range(4):
        assert torch.isfinite(module.training_step(batch, 0))
    assert logged == ["train/loss", "train/unlikelihood", "train/loss", "train/unlikelihood"]


@pytest.mark.parametrize("field, value", [("every_n_steps", -1), ("prefix_len", 0), ("continuation_len", 0), ("ngram", 1)])
def test_bad_unlikelihood_settings_name_their_key(field, value):
    with pytest.raises(UserError, match=f"unlikelihood.{field}"):
        UnlikelihoodConfig(**{field: value})
