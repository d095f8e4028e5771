"""vLLM's speculators 0.9.0 trains DSpark on a CPU, from a clone:

    python -m benchmarks.peers.speculators_dspark N STEPS OUT [WORK]

trains its DSpark drafter (speculators/models/dspark) for the demo target on the first N conversations of
data/sharegpt-smollm2 (our data.max_examples=N, rows rendered and masked by train/data.py) for STEPS optimizer
steps, and writes OUT, a folder our engine serves (`python -m inference drafter=OUT quant=gguf`). The venv,
the rows and the hidden states are speculators_peer.py's: the same files serve its EAGLE-3 and its DSpark
(layers [2, 15, 27] for the features, the last pre-norm state for the verifier's logits, which DSpark's loss
and confidence head read).

The recipe is ours (conf=dspark_smollm2): one Qwen3 layer of the target's widths, full attention, feature
layers [2, 15, 27], an 8,192-token draft vocabulary, block 8 with the anchor's slot drafting, slot j weighted
exp(-j/4), 32 anchors a row (128 a step of 4 rows), a vanilla Markov head of rank 256, a confidence head on
[hidden, W1[previous token]] with BCE against 1 - TV weighted 1, our mask token (the least frequent token of
the train rows' trained tokens), AdamW lr 1e-3 betas 0.9,0.95 without weight decay, 10 warm-up steps then
cosine, 4 x 512 tokens a step. Environment: speculators_peer.py's (SEED, LR, ADAMW_BETAS, DRAFT_VOCAB,
TOTAL_SEQ_LEN, OMP_NUM_THREADS, EXTRA) plus BLOCK (8), ANCHORS (128 a packed step), MARKOV_RANK (256),
MARKOV_TYPE (vanilla), MASK_TOKEN (ours).

What it does not let you change (beside speculators_peer.py's: its cosine decays to 0, its positions whose
target token is outside the draft vocabulary count): its mask token's embedding is the target's row, frozen
(ours learns it); it packs rows into one 2,048-token sequence and draws the step's anchors over all of it
(ours: 32 in each row); a slot counts when the token at its anchor + slot is trained (ours: the token it
drafts, one further); its loss is one masked mean over every slot (ours: a mean per slot, then the weighted sum).
"""

import json
import os
import sys
from pathlib import Path

from benchmarks.peers import target_folder
from benchmarks.peers.speculators_peer import LAYERS, VENV, prepare, report, train, work_dir


def mask_token(rows_file: Path, vocab_size: int) -> int:
    """Our DSpark's mask token for these rows: the least frequent trained token of the train rows."""
    import torch

    from speculators.mask_token import least_frequent

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in json.loads(rows_file.read_text())["train"]:
        counts += torch.bincount(torch.tensor([i for i, m in zip(ids, mask) if m], dtype=torch.long), minlength=vocab_size)
    return least_frequent(counts)


def train_args(target: Path, data: Path, work: Path, steps: int, env: dict[str, str], mask: int) -> list[str]:
    """`speculators train --speculator-type dspark`'s flags for our recipe (see the module's docstring)."""
    ratio = json.loads((data / "split.json").read_text())["train_data_ratio"]
    get = lambda key, default: env.get(key) or default  # noqa: E731
    return ["--speculator-type", "dspark", "--verifier-name-or-path", str(target),
            "--data-path", str(data), "--hidden-states-backend", "file", "--on-missing", "raise",
            "--train-data-ratio", str(ratio), "--total-seq-len", get("TOTAL_SEQ_LEN", "2048"),
            "--hidden-states-dtype", "bfloat16", "--num-workers", "0",
            "--target-layer-ids", *map(str, LAYERS), "--draft-vocab-size", get("DRAFT_VOCAB", "8192"),
            "--num-layers", "1", "--draft-arch", "qwen3", "--full-attention-indices", "0", "--draft-attn-impl", "sdpa",
            "--mask-token-id", get("MASK_TOKEN", str(mask)),
            "--block-size", get("BLOCK", "8"), "--sample-from-anchor", "--max-anchors", get("ANCHORS", "128"),
            "--dflash-decay-gamma", "4", "--per-position-loss-weight", "fixed-exp-decay",
            "--markov-rank", get("MARKOV_RANK", "256"), "--markov-head-type", get("MARKOV_TYPE", "vanilla"),
            "--enable-confidence-head", "--confidence-head-with-markov", "--confidence-head-alpha", "1.0",
            "--loss-implementation", "eager", "--loss-fn", "kl_div",
            "--optimizer", "adamw", "--lr", get("LR", "1e-3"), "--weight-decay", "0",
            "--scheduler-type", "cosine", "--scheduler-warmup-steps", "10",
            "--epochs", "1000000", "--max-steps", str(steps), "--checkpoint-freq", "1000000", "--log-freq", "1",
            "--save-path", str(work / "ckpt"), "--log-dir", str(work / "logs"), "--seed", get("SEED", "0"),
            *env.get("EXTRA", "").split()]


def our_logits(export_dir: Path, inputs: dict, target: Path):
    """Our reader's DSpark on the worker's inputs: (Markov-biased logits [A, B, N], confidence logits [A, B])."""
    import torch
    from safetensors import safe_open

    from speculators import export as our_export

    drafter, _ = our_export.load(export_dir)
    with safe_open(str(next(target.glob("*.safetensors"))), "pt") as f:  # the target's embeddings, as served
        drafter.embed_tokens.weight.data.copy_(f.get_tensor("model.embed_tokens.weight").float())
    drafter.reset_mask_embedding()
    drafter = drafter.float().eval()
    with torch.no_grad():
        context = drafter.hidden_norm(drafter.fc(inputs["features"]))
        hidden = drafter.norm(drafter.block_forward(context, inputs["input_ids"], inputs["anchors"][None])[0])
        tokens = inputs["input_ids"][0, inputs["anchors"][:, None] + torch.arange(hidden.shape[1])]
        prev = drafter.markov_head.markov_w1(tokens)
        logits = drafter.lm_head(hidden) + drafter.markov_head.block_bias(prev, hidden)
        return logits, drafter.confidence(hidden, prev)


def logits_difference(checkpoint: Path, export_dir: Path, work: Path, threads: int) -> dict:
    """The largest differences between speculators' DSpark (its checkpoint, in its venv) and our reader's
    (its export) on the same random inputs and anchors: Markov-biased logits and confidence logits."""
    from safetensors.torch import load_file

    file = work / "logits.safetensors"
    VENV.run("speculators_worker.py", ["logits", str(checkpoint), str(file)], threads)
    theirs = load_file(str(file))
    logits, confidence = our_logits(export_dir, theirs, target_folder())
    return {"logits_max_abs_diff": float((logits - theirs["logits"]).abs().max()),
            "logits_max_abs": float(theirs["logits"].abs().max()),
            "confidence_max_abs_diff": float((confidence - theirs["confidence"]).abs().max()),
            "same_argmax": bool((logits.argmax(-1) == theirs["logits"].argmax(-1)).all())}


def run(n: int, steps: int, out: Path, work: Path | None = None, env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) | (env or {})
    threads = int(env.get("OMP_NUM_THREADS") or 1)
    work = work or work_dir(n)
    data, seconds = prepare(n, work, threads)
    target = target_folder()
    rows = work / "rows.json" if (work / "rows.json").is_file() else data.resolve().parent / "rows.json"
    mask = mask_token(rows, json.loads((target / "config.json").read_text())["vocab_size"])
    print(f"== speculators train --speculator-type dspark: {steps} steps, mask token {mask}", flush=True)
    knobs = {"ADAMW_BETAS": env.get("ADAMW_BETAS") or "0.9,0.95"}
    final = train(work, train_args(target, data, work, steps, env, mask), threads, knobs, out, seconds)
    print(f"== logits against speculators' own model: {json.dumps(logits_difference(final, out, work, threads))}",
          flush=True)
    report(final, out, seconds, threads)
    return out


def main(argv: list[str]) -> None:
    from common.config import exit_on_user_error

    if len(argv) not in (3, 4) or not all(a.isdigit() for a in argv[:2]) or int(argv[1]) < 1:
        raise SystemExit(__doc__.split("\n\n")[1])
    exit_on_user_error(lambda: run(int(argv[0]), int(argv[1]), Path(argv[2]), Path(argv[3]) if len(argv) > 3 else None))()


if __name__ == "__main__":
    main(sys.argv[1:])
