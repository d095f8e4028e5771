"""benchmarks.target_card: the card and heldout.json of a tiny random Llama, and one-line errors."""

import json
import math
import subprocess
import sys

import datasets
import pytest
import torch

from benchmarks import target_card
from common import corpus
from common.config import PROJECT_ROOT
from train.data import DataConfig
from train.optim import OptimConfig
from train.pretrain import (
    CausalLMModule,
    ModelConfig,
    build_model,
    save_target,
    token_byte_lengths,
    train_tokenizer,
)

SEQ_LEN = 64
CHOICES = {"corpus": "stdlib: on every machine, offline", "vocab": "4k BPE: small enough for a CPU"}


@pytest.fixture(scope="module")
def stdlib():
    return corpus.stdlib_files(None, include_tests=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, stdlib):
    """What train.pretrain saves, written by its own save_target, for a 2-layer 32-wide Llama."""
    torch.manual_seed(0)
    tokenizer = train_tokenizer(stdlib["train"]["text"][:20], vocab_size=300)
    model = build_model(ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128), tokenizer)
    module = CausalLMModule(model, OptimConfig(), max_steps=1, byte_lengths=token_byte_lengths(tokenizer))
    # A few train files keep save_target's token count fast; the hash is then fixed to the full corpus's.
    small = datasets.DatasetDict(train=stdlib["train"].select(range(5)), validation=stdlib["validation"], test=stdlib["test"])
    out = tmp_path_factory.mktemp("target") / "model"
    save_target(module, tokenizer, small, out, tokens_seen=SEQ_LEN * 8, wall_time_s=60, data_cfg=DataConfig(seq_len=SEQ_LEN))
    facts = json.loads((out / "training.json").read_text())
    facts["corpus"]["content_hash"] = corpus.corpus_hash(stdlib)
    facts["choices"] = CHOICES
    (out / "training.json").write_text(json.dumps(facts))
    return out


def test_card_and_heldout_written_with_finite_numbers(model_dir, capsys):
    target_card.main([f"model_dir={model_dir}", f"max_test_tokens={2 * SEQ_LEN}", "samples=2"])
    printed = capsys.readouterr()
    assert "warning" not in printed.err

    heldout = json.loads((model_dir / "heldout.json").read_text())
    assert math.isfinite(heldout["nats_per_token"]) and heldout["nats_per_token"] > 0
    assert math.isfinite(heldout["bits_per_byte"]) and heldout["bits_per_byte"] > 0
    assert heldout["tokens_evaluated"] == 2 * (SEQ_LEN - 1)  # two rows, every token but each row's first scored
    assert heldout["whole_test_split"] is False and heldout["content_hash"] == heldout["content_hash_trained"]

    lines = printed.out.splitlines()
    assert f"held-out nats/token: {heldout['nats_per_token']:.4f}" in lines
    assert f"held-out bits/byte: {heldout['bits_per_byte']:.4f}" in lines

    card = (model_dir / "README.md").read_text()
    for section in ("## Model", "## Corpus", "## Training", "## Held-out loss", "## Samples"):
        assert section in card
    assert f"{heldout['nats_per_token']:.4f} nats/token" in card
    assert f"{heldout['bits_per_byte']:.4f} bits per byte" in card
    assert heldout["command"] in card and "max_test_tokens=128" in heldout["command"]
    assert "| layers | 2 |" in card and "| key/value heads | 1 |" in card
    assert all(why in card for why in CHOICES.values())
    assert card.count("```python") == 2 * 3  # prompt, greedy and T=0.8 for each of the two samples
    rep = heldout["repetition"]
    assert 0 <= rep["looping"] <= rep["files"] > 0 and 0 <= rep["sampled_looping"] <= rep["files"]
    assert 0 <= rep["greedy_rep4"] <= 1 and 0 < rep["source_rep4"] < 1  # real code repeats a little
    assert f"greedy {rep['looping']} of {rep['files']}" in card
    assert f"temperature 0.8 {rep['sampled_looping']} of {rep['files']}" in card
    assert f"greedy {rep['greedy_rep4']:.3f}; the files' own next 120 tokens {rep['source_rep4']:.3f}" in card


def test_card_names_every_run_of_a_chain():
    """Three runs, the last with unlikelihood steps: each later training.json nests the one before."""
    first = {"tokens_seen": 1000, "wall_time_s": 3600}
    second = {"tokens_seen": 1500, "wall_time_s": 5400, "continued_from": first}
    unlikelihood = {"every_n_steps": 2, "prefix_len": 50, "continuation_len": 100, "ngram": 4, "steps": 40,
                    "next_token_steps": 40}
    third = {"tokens_seen": 1800, "wall_time_s": 7200, "continued_from": second, "unlikelihood": unlikelihood}
    assert target_card.training_runs(third) == [first, second, third]
    text = target_card.describe_runs(target_card.training_runs(third))
    assert text.startswith("in 3 runs: 1,000 tokens from scratch (1.00 h), then 500 more continuing that model (0.50 h), "
                           "then 300 more continuing that model (0.50 h), plus 40 sequence-level unlikelihood steps")
    assert "repeated 4-grams" in text


def test_changed_corpus_is_warned_about(model_dir, tmp_path, capsys):
    other = tmp_path / "model"
    other.mkdir()
    for f in model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    facts = json.loads((other / "training.json").read_text())
    facts["corpus"]["content_hash"] = "0123456789abcdef"
    (other / "training.json").write_text(json.dumps(facts))

    target_card.main([f"model_dir={other}", f"max_test_tokens={SEQ_LEN}", "samples=0"])
    assert "0123456789abcdef" in capsys.readouterr().err
    card = (other / "README.md").read_text()
    assert "**Warning:**" in card and "## Samples" not in card


def one_line_error(result) -> str:
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_missing_folder_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    result = subprocess.run([sys.executable, "-m", "benchmarks.target_card", f"model_dir={missing}"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert str(missing) in one_line_error(result) and "does not exist" in result.stderr


@pytest.mark.parametrize("broken", ["empty folder", "no training.json", "garbage weights"])
def test_folder_that_is_not_a_model_is_one_line(broken, model_dir, tmp_path, capsys):
    if broken != "empty folder":
        (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    if broken == "garbage weights":
        (tmp_path / "training.json").write_text((model_dir / "training.json").read_text())
        (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SystemExit) as stopped:
        target_card.main([f"model_dir={tmp_path}"])
    assert str(stopped.value).startswith("error: ") and "\n" not in str(stopped.value)


@pytest.mark.parametrize("tokens, share", [
    ([1, 2, 3, 4, 5], 0.0),            # two 4-grams, both new
    ([7] * 6, 2 / 3),                  # three 4-grams, all (7, 7, 7, 7)
    ([1, 2, 3, 4, 1, 2, 3, 4], 0.2),   # five 4-grams, the last one a repeat of the first
])
def test_repeated_4gram_share(tokens, share):
    assert target_card.repeated_4gram_share(tokens) == pytest.approx(share)


@pytest.mark.parametrize("tokens, loops", [
    ([1, 2, 3] * 30, True),                      # one 3-token phrase over and over
    (list(range(40)) + [7] * 60, True),          # settles into one token
    (list(range(100)), False),                   # never repeats
    ([1, 2, 3] * 10 + list(range(60)), False),   # repeated early, then moved on
    ([1, 2] * 10, False),                        # too short to judge
])
def test_a_continuation_loops_when_its_tail_repeats_one_phrase(tokens, loops):
    assert target_card.falls_into_a_loop(tokens) is loops
