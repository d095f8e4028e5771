"""Measure a pretrained target on held-out standard-library files and write its model card.

    python -m benchmarks.target_card model_dir=<model dir> [max_test_tokens=N] [samples=K]

Reads the folder `train.pretrain` saved (weights, tokenizer, training.json), rebuilds the
corpus it was trained on, measures the loss on the TEST split (files no model ever trains
on), samples a few continuations, and writes <dir>/README.md and <dir>/heldout.json. Every
number in the card is read from those files or measured here; nothing is typed in by hand.
"""

import json
import math
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from common.config import UserError, at_least, run_command

PROMPT_LINES = 6  # a file's first lines: its imports or docstring, enough to set the scene
NEW_TOKENS = 120
TEMPERATURE = 0.8
SEED = 0
EVAL_BATCH = 8
LOOP_TAIL, LOOP_MAX_PERIOD = 60, 20  # a continuation loops if its last 60 tokens repeat a phrase of <= 20 tokens
REQUIRED_FACTS = ("corpus.include_tests", "corpus.content_hash", "corpus.files", "corpus.bytes",
                  "corpus.tokens", "seq_len", "tokens_seen", "wall_time_s")


@dataclass
class TargetCardConfig:
    """conf/benchmarks/target_card.yaml."""

    model_dir: str = MISSING  # a folder written by train.pretrain
    max_test_tokens: int | None = None  # None: the whole test split
    samples: int = 3  # held-out files to continue


def read_training_facts(model_dir: Path) -> dict:
    """training.json, checked before the slow imports so bad input fails in a fraction of a second."""
    if not model_dir.exists():
        raise UserError(f"model folder {model_dir} does not exist")
    if not model_dir.is_dir():
        raise UserError(f"{model_dir} is not a folder")
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir} is not a model folder (no config.json)")
    path = model_dir / "training.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no training.json: it was not written by train.pretrain")
    try:
        facts = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    for dotted in REQUIRED_FACTS:
        node = facts
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                raise UserError(f"{path} lacks '{dotted}'")
            node = node[key]
    return facts


def load_model_and_tokenizer(model_dir: Path):
    """fp32 weights: bf16 arithmetic is unusably slow on CPUs without bf16 units."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # corrupt or foreign files raise many kinds; the user needs one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load a causal LM and tokenizer from {model_dir}: {first}") from None
    return model, tokenizer


def rebuild_corpus(facts: dict):
    """The same files the model saw, split by path hash; the hash tells us if they really are."""
    from common import corpus

    files = corpus.stdlib_files(None, facts["corpus"]["include_tests"])
    measured, trained = corpus.corpus_hash(files), facts["corpus"]["content_hash"]
    warning = None
    if measured != trained:
        warning = (f"corpus content hash {measured} differs from training.json's {trained}: this Python "
                   f"({platform.python_version()}) has a different standard library than the one the model was "
                   "trained on, so the test split and the held-out figures are not those of the training run")
        print(f"warning: {warning}", file=sys.stderr)
    return files, measured, warning


def measure_heldout(model, tokenizer, test_files, seq_len: int, max_tokens: int | None) -> dict:
    """Loss over the packed test split, batch by batch so a progress bar can show it."""
    from tqdm import tqdm

    from train.data import pack
    from train.pretrain import loss_in_bits_per_byte, token_byte_lengths

    rows = pack(test_files, tokenizer, seq_len)
    all_rows = len(rows)
    if max_tokens is not None:
        rows = rows[: max(1, max_tokens // seq_len)]  # whole sequences: a cut row would change the context
    byte_lengths = token_byte_lengths(tokenizer)
    nats = tokens = nbytes = 0.0
    for batch in tqdm(rows.split(EVAL_BATCH), desc="held-out loss", unit="batch"):
        nats_per_token, _ = loss_in_bits_per_byte(model, batch, byte_lengths, batch_size=len(batch))
        targets = batch[:, 1:]  # what loss_in_bits_per_byte scores: every token but each row's first
        nats += nats_per_token * targets.numel()
        tokens += targets.numel()
        nbytes += byte_lengths[targets].sum().item()
    return {
        "nats_per_token": nats / tokens,
        "bits_per_byte": nats / math.log(2) / nbytes,
        "tokens_evaluated": int(tokens),
        "bytes_evaluated": int(nbytes),
        "sequences_evaluated": len(rows),
        "test_sequences": all_rows,
        "whole_test_split": len(rows) == all_rows,
        "seq_len": seq_len,
    }


def generate_samples(model, tokenizer, test_files, k: int) -> list[dict]:
    """Greedy and T=0.8 continuations of the opening lines of k test files spread over the split."""
    import torch

    eligible = [(p, t) for p, t in zip(test_files["path"], test_files["text"]) if len(t.splitlines()) > PROMPT_LINES]
    k = min(k, len(eligible))
    chosen = [eligible[i * len(eligible) // k] for i in range(k)]
    samples = []
    for path, text in chosen:
        prompt = "".join(text.splitlines(keepends=True)[:PROMPT_LINES])
        inputs = tokenizer(prompt, return_tensors="pt")
        n = inputs["input_ids"].shape[1]

        def continue_prompt(**how) -> str:
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id, **how)
            return tokenizer.decode(out[0, n:], skip_special_tokens=True)

        greedy = continue_prompt(do_sample=False)
        torch.manual_seed(SEED)  # per sample, so each one reproduces on its own
        # top_k/top_p off: the card promises plain temperature sampling, not generate's defaults
        sampled = continue_prompt(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0)
        samples.append({"path": path, "prompt": prompt, "greedy": greedy, "sampled": sampled})
    return samples


def falls_into_a_loop(tokens: list[int], tail: int = LOOP_TAIL, max_period: int = LOOP_MAX_PERIOD) -> bool:
    """True when the last `tail` tokens repeat one phrase of at most `max_period` tokens."""
    end = tokens[-tail:]
    return len(end) == tail and any(all(end[i] == end[i - p] for i in range(p, tail)) for p in range(1, max_period + 1))


def repeated_4gram_share(tokens: list[int]) -> float:
    """seq-rep-4 (Welleck et al., 2020): the share of a text's 4-grams that already occurred in it."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def repetition(model, tokenizer, test_files) -> dict:
    """How much continuations of test files' openings repeat themselves: how many end looping one
    phrase (greedy, and sampled at the card's temperature, seeded per file as the samples are), and
    the mean seq-rep-4 of the greedy ones beside that of the files' own next NEW_TOKENS tokens."""
    import torch
    from tqdm import tqdm

    texts = [t for t in test_files["text"] if len(t.splitlines()) > PROMPT_LINES]
    found = {"files": len(texts), "looping": 0, "sampled_looping": 0, "greedy_rep4": 0.0, "source_rep4": 0.0}
    for text in tqdm(texts, desc="repetition", unit="file"):
        prompt = "".join(text.splitlines(keepends=True)[:PROMPT_LINES])
        inputs = tokenizer(prompt, return_tensors="pt")
        for key, how in (("looping", dict(do_sample=False)),
                         ("sampled_looping", dict(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0))):
            torch.manual_seed(SEED)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id, **how)
            continuation = out[0, inputs["input_ids"].shape[1]:].tolist()
            found[key] += falls_into_a_loop(continuation)
            if key == "looping":
                found["greedy_rep4"] += repeated_4gram_share(continuation) / len(texts)
        source = tokenizer(text[len(prompt):])["input_ids"][:NEW_TOKENS]
        found["source_rep4"] += repeated_4gram_share(source) / len(texts)
    return found


def training_runs(facts: dict) -> list[dict]:
    """The runs that made the model, first to last: each init_from= run nests the facts of the one before."""
    runs = [facts]
    while runs[0].get("continued_from"):
        runs.insert(0, runs[0]["continued_from"])
    return runs


def describe_runs(runs: list[dict]) -> str:
    """'in 3 runs: 7,168,000 tokens from scratch (1.97 h), then ... more continuing that model (`init_from=`)'."""
    parts, before = [], {"tokens_seen": 0, "wall_time_s": 0}
    for i, run in enumerate(runs):
        tokens, hours = run["tokens_seen"] - before["tokens_seen"], (run["wall_time_s"] - before["wall_time_s"]) / 3600
        text = f"{tokens:,} tokens from scratch" if i == 0 else f"then {tokens:,} more continuing that model"
        text += f" ({hours:.2f} h)"
        ul = run.get("unlikelihood")
        if ul:
            text += (f", plus {ul['steps']:,} sequence-level unlikelihood steps (one step in {ul['every_n_steps']}: the "
                     f"model's greedy continuations of {ul['continuation_len']} tokens after {ul['prefix_len']}-token "
                     f"prefixes, its tokens inside repeated {ul['ngram']}-grams penalised)")
        parts.append(text)
        before = run
    return f"in {len(runs)} runs: " + ", ".join(parts) + " (each later run `init_from=` the one before)"


def fenced(code: str, lang: str = "python") -> str:
    """A fence longer than any backtick run inside, so generated text cannot break out of it."""
    longest, run = 0, 0
    for ch in code:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{code.rstrip(chr(10))}\n{fence}"


def render_card(model_dir: Path, model, facts: dict, heldout: dict, samples: list[dict], warning: str | None) -> str:
    cfg, corpus = model.config, facts["corpus"]
    params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    arch = ", ".join(cfg.architectures or [type(model).__name__])
    stored = json.loads((model_dir / "config.json").read_text())
    stored_dtype = stored.get("dtype") or stored.get("torch_dtype") or "an unrecorded dtype"  # as saved, not as loaded
    heads = f"{cfg.num_attention_heads} (head dim {getattr(cfg, 'head_dim', None) or cfg.hidden_size // cfg.num_attention_heads})"
    lines = [
        f"# {arch}: {params / 1e6:.1f}M parameters, trained on Python standard library source",
        "",
        "Generated by `python -m benchmarks.target_card` from config.json, training.json and measurements",
        "made when it ran; rerun it to refresh this card.",
        "",
        "## Model",
        "",
        "| | |", "|---|---|",
        f"| architecture | {arch} (`{cfg.model_type}`) |",
        f"| layers | {cfg.num_hidden_layers} |",
        f"| hidden size | {cfg.hidden_size} |",
        f"| MLP size | {cfg.intermediate_size} |",
        f"| attention heads | {heads} |",
        f"| key/value heads | {cfg.num_key_value_heads} |",
        f"| vocabulary | {cfg.vocab_size} |",
        f"| max positions | {cfg.max_position_embeddings} |",
        f"| tied embeddings | {cfg.tie_word_embeddings} |",
        f"| parameters | {params:,} |",
        "",
        f"Weights are stored in {stored_dtype}; this card loaded them in float32 (CPUs without bf16 units compute fp32 far faster).",
        "",
        "## Corpus",
        "",
        f"{corpus.get('source', 'Python standard library')}; the stdlib's own test suites "
        f"{'included' if corpus['include_tests'] else 'excluded'} (`include_tests: {str(corpus['include_tests']).lower()}`). "
        "Files are split 90/5/5 by a hash of their relative path; no model trains on the test split.",
        f"Content hash `{corpus['content_hash']}`.",
        "",
        "| split | files | bytes | tokens | bytes/token |", "|---|---:|---:|---:|---:|",
    ]
    for split in ("train", "validation", "test"):
        b, t = corpus["bytes"][split], corpus["tokens"][split]
        lines.append(f"| {split} | {corpus['files'][split]:,} | {b:,} | {t:,} | {b / t:.2f} |")
    lines += [
        "",
        "## Training",
        "",
        f"- tokens seen: {facts['tokens_seen']:,} ({facts['tokens_seen'] / corpus['tokens']['train']:.2f} epochs of the train split)",
        f"- wall time: {facts['wall_time_s'] / 3600:.2f} h ({facts['wall_time_s']:,} s)",
        f"- sequence length: {facts['seq_len']}",
    ]
    runs = training_runs(facts)
    if len(runs) > 1:  # init_from=: the totals above add up every run
        lines.append(f"- {describe_runs(runs)}")
    choices = facts.get("choices")
    if choices:
        lines += ["", "Design choices:", ""]
        items = choices.items() if isinstance(choices, dict) else ((None, c) for c in choices)
        lines += [f"- **{name}**: {why}" if name is not None else f"- {why}" for name, why in items]
    scope = "the whole test split" if heldout["whole_test_split"] else "the first"
    scope += f" ({heldout['sequences_evaluated']} of {heldout['test_sequences']} packed sequences of {heldout['seq_len']}"
    scope += "; each sequence's first token has no context and is not scored)"
    lines += [
        "",
        "## Held-out loss",
        "",
        f"- {heldout['nats_per_token']:.4f} nats/token (perplexity {math.exp(heldout['nats_per_token']):.2f})",
        f"- {heldout['bits_per_byte']:.4f} bits per byte of source text",
        f"- {heldout['tokens_evaluated']:,} tokens evaluated: {scope}",
        f"- measured with Python {heldout['python']}; reproduce with `{heldout['command']}`",
    ]
    rep = heldout.get("repetition")
    if rep:
        lines += [f"- continuations that end looping one phrase, of {rep['files']} test files (the first {PROMPT_LINES} "
                  f"lines of each, {NEW_TOKENS} new tokens; looping = the last {LOOP_TAIL} tokens repeat a phrase of at "
                  f"most {LOOP_MAX_PERIOD}): greedy {rep['looping']} of {rep['files']}, "
                  f"sampled at temperature {TEMPERATURE} {rep['sampled_looping']} of {rep['files']}",
                  f"- repeated 4-grams (seq-rep-4: the share of a continuation's 4-grams that already occurred in it, mean "
                  f"over those files): greedy {rep['greedy_rep4']:.3f}; the files' own next {NEW_TOKENS} tokens "
                  f"{rep['source_rep4']:.3f}"]
    if warning:
        lines += ["", f"**Warning:** {warning}."]
    if samples:
        lines += ["", "## Samples", "",
                  f"The first {PROMPT_LINES} lines of held-out files, continued for up to {NEW_TOKENS} tokens: greedy, "
                  f"then sampled at temperature {TEMPERATURE} (no top-k/top-p, seed {SEED})."]
        for s in samples:
            lines += ["", f"### `{s['path']}`", "", "Prompt:", "", fenced(s["prompt"]), "",
                      "Greedy:", "", fenced(s["greedy"]), "", f"T={TEMPERATURE}:", "", fenced(s["sampled"])]
    return "\n".join(lines) + "\n"


def card(args: TargetCardConfig, argv: list[str]) -> None:
    if args.max_test_tokens is not None:
        at_least(1, max_test_tokens=args.max_test_tokens)
    at_least(0, samples=args.samples)
    args.model_dir = Path(args.model_dir)
    facts = read_training_facts(args.model_dir)
    model, tokenizer = load_model_and_tokenizer(args.model_dir)
    files, content_hash, warning = rebuild_corpus(facts)
    heldout = measure_heldout(model, tokenizer, files["test"], facts["seq_len"], args.max_test_tokens)
    heldout.update(content_hash=content_hash, content_hash_trained=facts["corpus"]["content_hash"],
                   python=platform.python_version(),
                   command=shlex.join(["python", "-m", "benchmarks.target_card", *argv]))
    samples = generate_samples(model, tokenizer, files["test"], args.samples)
    heldout["repetition"] = repetition(model, tokenizer, files["test"])
    (args.model_dir / "heldout.json").write_text(json.dumps(heldout, indent=2) + "\n")
    (args.model_dir / "README.md").write_text(render_card(args.model_dir, model, facts, heldout, samples, warning))
    print(f"held-out nats/token: {heldout['nats_per_token']:.4f}")
    print(f"held-out bits/byte: {heldout['bits_per_byte']:.4f}")
    print(f"held-out tokens evaluated: {heldout['tokens_evaluated']:,}" + ("" if heldout["whole_test_split"] else " (capped)"))
    print(f"card written to {args.model_dir / 'README.md'}")


def main(argv: list[str] | None = None) -> None:
    """The command; `argv` (tests) stands for the command line's overrides. Errors end in one line (exit 1)."""
    if argv is not None:
        sys.argv[1:] = argv
    overrides = sys.argv[1:]  # as typed, for heldout.json's `command`
    run_command("target_card", TargetCardConfig, lambda cfg: card(cfg, overrides), config_dir="conf/benchmarks")


if __name__ == "__main__":
    main()
