"""The shipped default target (models/pycode): it loads from the repo, keeps its card's
held-out loss and loop counts, and the default recipe trains and exports a drafter for it."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.target_card import repetition
from common.corpus import stdlib_files
from train.data import pack
from train.pretrain import loss_in_bits_per_byte, token_byte_lengths

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "pycode"
MARGIN_BITS_PER_BYTE = 0.15  # a few sequences scatter around the whole split's figure
LOOP_MARGIN = 2


def test_shipped_target_keeps_its_heldout_loss():
    card = json.loads((MODEL / "heldout.json").read_text())
    facts = json.loads((MODEL / "training.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows = pack(stdlib_files(None, facts["corpus"]["include_tests"])["test"], tokenizer, facts["seq_len"])
    _, bits_per_byte = loss_in_bits_per_byte(model, rows[:8], token_byte_lengths(tokenizer))
    assert bits_per_byte < card["bits_per_byte"] + MARGIN_BITS_PER_BYTE


def test_shipped_target_loops_no_more_than_its_card_says():
    """The card's loop counts (greedy and T=0.8 continuations of held-out files' openings) hold."""
    card = json.loads((MODEL / "heldout.json").read_text())["repetition"]
    facts = json.loads((MODEL / "training.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    test_files = stdlib_files(None, facts["corpus"]["include_tests"])["test"]
    measured = repetition(model, AutoTokenizer.from_pretrained(MODEL), test_files)
    assert measured["files"] == card["files"]
    # one or two near-ties may break the other way on another CPU's arithmetic
    assert measured["looping"] <= card["looping"] + LOOP_MARGIN
    assert measured["sampled_looping"] <= card["sampled_looping"] + LOOP_MARGIN


def test_default_recipe_trains_and_exports_for_the_shipped_target(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "conf=eagle3_pycode", "trainer.max_steps=20", "logger=none", f"hydra.run.dir={run_dir}",
           "trainer.progress_bar=false"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(MODEL)
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    assert d2t.dtype == torch.int64 and len(d2t) == config["draft_vocab_size"]
    assert t2d.dtype == torch.bool and len(t2d) == vocab
    assert json.loads((run_dir / "acceptance" / "report.json").read_text())["outputs_match_baseline"] is True
    assert f"export: {run_dir / 'export'}" in done.stdout


def test_shipped_assistant_shares_the_targets_tokenizer_and_drafts_for_it():
    """models/pycode-assistant (conf=assistant_pretrain) is benchmarks.bench's default peer: transformers'
    assisted generation with it must reproduce the target's greedy output."""
    assistant_dir = ROOT / "models" / "pycode-assistant"
    assert AutoTokenizer.from_pretrained(assistant_dir).get_vocab() == AutoTokenizer.from_pretrained(MODEL).get_vocab()
    target = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(MODEL)("import os\n\ndef main():\n", return_tensors="pt")["input_ids"]
    greedy = dict(do_sample=False, max_new_tokens=24, pad_token_id=target.generation_config.pad_token_id)
    assert torch.equal(target.generate(prompt, **greedy), target.generate(prompt, assistant_model=assistant, **greedy))


def test_tokenizer_training_is_deterministic():
    """Why the assistant recipe may train its own tokenizer: the same texts give the same merges."""
    from train.pretrain import train_tokenizer

    texts = [Path(m.__file__).read_text() for m in (json.decoder, json.encoder, subprocess)]
    assert train_tokenizer(texts, 600).get_vocab() == train_tokenizer(texts, 600).get_vocab()
