"""Tiny random targets (a Llama and a Qwen3) built from configs, with a real BPE tokenizer; no hub access."""

import json
import os
import re
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)

# Property-based tests draw the same cases on every run, so CI is reproducible; to search new
# ones, run with HYPOTHESIS_PROFILE=explore (a case it finds is a bug to fix, then keep it green).
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))

VOCAB_SIZE = 320  # byte-level BPE needs 257 (256 bytes + EOS); the rest are merges
NUM_LAYERS = 4
LAYER_IDS = [0, 1, 2]  # explicit: the default [2, L//2, L-3] is invalid for 4 layers
DRAFT_VOCAB = 96
FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="session")
def tokenizer():
    from train.pretrain import train_tokenizer

    texts = [Path(m.__file__).read_text() for m in (json.decoder, json.encoder, textwrap, string)]
    tok = train_tokenizer(texts, VOCAB_SIZE)
    assert len(tok) == VOCAB_SIZE, "the tokenizer corpus is too small for the requested vocabulary"
    return tok


def make_model(family: str, tokenizer, num_layers: int = NUM_LAYERS, seed: int = 0):
    """A tiny random causal LM of `family` whose vocabulary matches `tokenizer`."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if family == "qwen3":
        # head_dim 16 with 4 heads: q/k/v widths (64) differ from hidden_size (32), as in real Qwen3s.
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()
    raise ValueError(family)


@pytest.fixture(scope="session")
def target_dirs(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """family -> a save_pretrained folder holding the model and its tokenizer, and a training.json naming the
    standard library as its corpus (its tokenizer's is), as train.pretrain's do: recipes with data=stdlib take it."""
    from speculators.corpus import STDLIB_SOURCE

    dirs = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"tiny_{family}")
        make_model(family, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
        (path / "training.json").write_text(json.dumps({"corpus": {"source": STDLIB_SOURCE}}))
        dirs[family] = path
    return dirs


@pytest.fixture(scope="session")
def llama_dir(target_dirs) -> Path:
    return target_dirs["llama"]


@pytest.fixture(scope="session")
def qwen3_dir(target_dirs) -> Path:
    return target_dirs["qwen3"]


_loaded: dict[str, object] = {}


def load_target(target_dirs, family: str):
    from speculators.target import FrozenTarget, TargetConfig

    if family not in _loaded:
        _loaded[family] = FrozenTarget.load(TargetConfig(name_or_path=str(target_dirs[family]), layer_ids=LAYER_IDS))
    return _loaded[family]


@pytest.fixture(scope="session", params=FAMILIES)
def target(request, target_dirs):
    """A loaded FrozenTarget, once for each of llama and qwen3."""
    return load_target(target_dirs, request.param)


@pytest.fixture(scope="session")
def llama_target(target_dirs):
    return load_target(target_dirs, "llama")


@pytest.fixture(scope="session")
def text_batch(tokenizer) -> torch.Tensor:
    """[2, 48] token ids of real Python source (so token frequencies are skewed, as in training)."""
    text = Path(textwrap.__file__).read_text()
    ids = torch.tensor(tokenizer(text)["input_ids"][: 2 * 48])
    assert len(ids) == 2 * 48
    return ids.view(2, 48)


@pytest.fixture(scope="session")
def make_drafter(text_batch):
    """make_drafter(target, **Eagle3Config fields): an EAGLE-3 drafter whose draft vocab is the batch's top tokens."""
    from speculators import draft_vocab
    from speculators.eagle3 import Eagle3Config, Eagle3Drafter

    def make(target, seed: int = 0, **fields):
        torch.manual_seed(seed)
        fields = {"depth": 3, "draft_vocab_size": DRAFT_VOCAB, **fields}
        counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
        return Eagle3Drafter.from_target(Eagle3Config(**fields), target, counts)

    return make


def run_interpreted_tests(test_file: str) -> None:
    """Run `test_file`'s tests marked `interpreted` in a child process with TRITON_INTERPRET=1 (Triton
    reads it when first imported, so this process cannot switch), and require that none was skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                            test_file, "-k", "interpreted"], env=env, cwd=Path(__file__).parent.parent,
                           capture_output=True, text=True)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert re.search(r"^\d+ passed, \d+ deselected", summary), summary  # nothing skipped: Triton was interpreted


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: without it they are collected and skipped, all with one reason."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)
