"""vLLM's speculators 0.9.0 as a peer trainer on a CPU, from a clone:

    python -m benchmarks.peers.speculators_peer N STEPS OUT [WORK]   # STEPS=0: rows and hidden states only

trains its EAGLE-3 drafter for the demo target on the first N conversations of data/sharegpt-smollm2 (our
data.max_examples=N, the same 90/5/5 split, rows rendered and masked by train/data.py) for STEPS optimizer
steps, and writes OUT, a folder our engine serves (`python -m inference drafter=OUT quant=gguf`). WORK
(default <venv's folder>/work-N) keeps the rows and hidden states, reused by every run over the same N.
Its venv is made on the first run (speculators-forge/peers/speculators-0.9.0 under ~/.cache).

The recipe is ours (conf=eagle3_smollm2): one Llama layer of the target's widths, full attention, feature
layers [2, 15, 27], an 8,192-token draft vocabulary, K=5 training-time-test steps weighted 0.8^j, AdamW lr
1e-3 betas 0.9,0.95 without weight decay, 10 warm-up steps then cosine, 4 x 512 tokens a step, EAGLE-3.1 norms
off. Environment: SEED (0), TTT (5), LR (1e-3), ADAMW_BETAS (0.9,0.95), DRAFT_VOCAB (8192), SEQ_LEN (512),
TOTAL_SEQ_LEN (2048), OMP_NUM_THREADS (1), EXTRA (more `speculators train` flags, last: e.g.
"--norm-before-fc --norm-output --norm-before-residual --optimizer muon" for its own defaults).

What it takes, found on 0.9.0: a plain install pulls torch 2.14 with CUDA wheels (so --no-deps after torch
2.13); its data steps need a running vLLM server (the worker's `data` and `hidden` stages stand in); its
trainer needs the in-process CPU patches in speculators_worker.py train(). What it does not let you change:
its lm_head is frozen, it keeps positions whose target token is outside the draft vocabulary, its cosine
decays to 0. Its config.json lacks target_hidden_size; export() fills it in from fc.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.peers import TARGET, Venv, target_folder, write_rows
from common.config import UserError

VERSION = "0.9.0"
VENV = Venv(f"speculators-{VERSION}", (
    ("torch==2.13.0",),  # first: speculators' own pins would pull torch 2.14's CUDA build
    ("--no-deps", f"speculators=={VERSION}", f"hs-connectors=={VERSION}"),
    ("transformers>=5.0.0,<=5.19.0", "datasets>=4.0.0,<=5.1.0", "loguru>=0.7.2,<=0.7.3", "pydantic", "pydantic-settings",
     "typer", "rich", "tqdm>=4.66.3,<=4.70.1", "safetensors", "openai", "numpy>=2,<=2.5.4", "psutil", "protobuf",
     "click", "httpx", "aiohttp", "accelerate")))
LAYERS = (2, 15, 27)  # ours: HF hidden_states[l], the input of decoder layer l


def work_dir(n: int) -> Path:
    return VENV.path.parent / f"work-{n}"


def train_args(target: Path, data: Path, work: Path, steps: int, env: dict[str, str]) -> list[str]:
    """`speculators train`'s flags for our recipe (the knobs from `env`, see the module's docstring)."""
    ratio = json.loads((data / "split.json").read_text())["train_data_ratio"]
    get = lambda key, default: env.get(key) or default  # noqa: E731
    return ["--speculator-type", "eagle3", "--verifier-name-or-path", str(target),
            "--data-path", str(data), "--hidden-states-backend", "file", "--on-missing", "raise",
            "--train-data-ratio", str(ratio), "--total-seq-len", get("TOTAL_SEQ_LEN", "2048"),
            "--hidden-states-dtype", "bfloat16", "--num-workers", "0",
            "--target-layer-ids", *map(str, LAYERS), "--draft-vocab-size", get("DRAFT_VOCAB", "8192"),
            "--num-layers", "1", "--draft-arch", "llama", "--full-attention-indices", "0", "--draft-attn-impl", "sdpa",
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
            "--loss-implementation", "eager", "--loss-fn", "kl_div", "--ttt-steps", get("TTT", "5"),
            "--ttt-step-loss-decay", "0.8", "--optimizer", "adamw", "--lr", get("LR", "1e-3"), "--weight-decay", "0",
            "--scheduler-type", "cosine", "--scheduler-warmup-steps", "10",
            "--epochs", "1000000", "--max-steps", str(steps), "--checkpoint-freq", "1000000", "--log-freq", "1",
            "--save-path", str(work / "ckpt"), "--log-dir", str(work / "logs"), "--seed", get("SEED", "0"),
            *env.get("EXTRA", "").split()]


def prepare(n: int, work: Path, threads: int) -> tuple[Path, dict]:
    """WORK/data: the rows and the target's hidden states of the first `n` conversations (each kept once made);
    the seconds each stage took."""
    VENV.ensure()
    target, data = target_folder(), work / "data"
    seq_len = os.environ.get("SEQ_LEN", "512")
    seconds = {}
    t = time.time()
    if not (data / "split.json").is_file():
        print(f"== rows: the first {n} conversations -> {data}", flush=True)
        print(json.dumps(write_rows(n, int(seq_len), work / "rows.json", target)), flush=True)
        VENV.run("speculators_worker.py", ["data", str(work / "rows.json"), str(data), str(target), seq_len], threads)
    seconds["rows"], t = time.time() - t, time.time()
    if not (data / "hidden.done").is_file():
        print(f"== hidden states of layers {list(LAYERS)} and the last pre-norm state -> {data / 'hidden_states'}", flush=True)
        VENV.run("speculators_worker.py", ["hidden", str(data), str(target), *map(str, LAYERS)], threads,
                 {"HIDDEN_DTYPE": os.environ.get("HIDDEN_DTYPE", "bfloat16")})
        (data / "hidden.done").write_text("")
    seconds["hidden_states"] = time.time() - t
    return data, seconds


def export(checkpoint: Path, out: Path, target: str = TARGET) -> Path:
    """speculators' checkpoint folder (EAGLE-3 or DSpark) -> ours: target_hidden_size (null in 0.9.0's config when
    the draft and target widths agree) from fc's input width, the verifier named as the GGUF we serve, the weights
    unchanged; optimizer and scheduler files left out. A DSpark checkpoint saves no embed_tokens (the target's, its
    mask row included): our loader takes the target's, as speculators does."""
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        fc_in = f.get_slice("fc.weight").get_shape()[1]
    layer_ids = next(v for k, v in config.items() if k.endswith("aux_hidden_state_layer_ids"))
    if config.get("target_hidden_size") is None:
        config["target_hidden_size"] = fc_in // len(layer_ids)
    config["speculators_config"]["verifier"] = {"name_or_path": target, "architectures": []}
    config.pop("auto_map", None)  # names the checkpoint's own config.py
    config["torch_dtype"] = config.get("dtype", "bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(checkpoint / "model.safetensors", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def train(work: Path, args: list[str], threads: int, knobs: dict[str, str], out: Path, seconds: dict) -> Path:
    """`speculators train` with `args` into WORK/ckpt (afresh: speculators resumes from --save-path), its final
    checkpoint exported to OUT; the checkpoint's folder. Adds the training's seconds to `seconds`."""
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    t = time.time()
    VENV.run("speculators_worker.py", ["train", *args], threads, knobs)
    seconds["training"] = time.time() - t
    final = work / "ckpt" / "final"
    if not (final / "model.safetensors").is_file():
        raise UserError(f"speculators wrote no final checkpoint in {work / 'ckpt'}")
    export(final, out)
    return final


def report(final: Path, out: Path, seconds: dict, threads: int) -> None:
    print("== seconds: " + ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in seconds.items())
          + f" (OMP_NUM_THREADS={threads})", flush=True)
    print(f"speculators checkpoint: {final}\nproject export: {out}   "
          f"(python -m inference drafter={out} quant=gguf eval=mtbench)", flush=True)


def run(n: int, steps: int, out: Path, work: Path | None = None, env: dict[str, str] | None = None) -> Path | None:
    env = dict(os.environ) | (env or {})
    threads = int(env.get("OMP_NUM_THREADS") or 1)
    work = work or work_dir(n)
    data, seconds = prepare(n, work, threads)
    if steps == 0:
        return None
    print(f"== speculators train: {steps} steps", flush=True)
    knobs = {k: env[k] for k in ("ADAMW_BETAS",) if k in env} or {"ADAMW_BETAS": "0.9,0.95"}
    final = train(work, train_args(target_folder(), data, work, steps, env), threads, knobs, out, seconds)
    report(final, out, seconds, threads)
    return out


def main(argv: list[str]) -> None:
    from common.config import exit_on_user_error

    if len(argv) not in (3, 4) or not all(a.isdigit() for a in argv[:2]):
        raise SystemExit(__doc__.split("\n\n")[1])
    exit_on_user_error(lambda: run(int(argv[0]), int(argv[1]), Path(argv[2]), Path(argv[3]) if len(argv) > 3 else None))()


if __name__ == "__main__":
    main(sys.argv[1:])
