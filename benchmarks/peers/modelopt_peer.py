"""NVIDIA ModelOpt 0.47's EAGLE-3 as a second peer trainer on a CPU:

    python -m benchmarks.peers.modelopt_peer N STEPS OUT [WORK]

trains ModelOpt's EAGLE-3 (modelopt.torch.speculative, `mtsp.convert(model, [("eagle", config)])`, online:
the frozen target inside every step) for the demo target on the rows `python train.py conf=eagle3_smollm2
data.max_examples=N` trains on (train/data.py's split, rendering and mask; 4 rows of up to 512 tokens a step),
exports it with ModelOpt's own exporter (WORK/modelopt: the HF EAGLE-3 layout TensorRT-LLM reads), then
converts that to our export OUT (`python -m inference drafter=OUT quant=gguf`). Its venv is made on the first
run (speculators-forge/peers/modelopt-0.47.0 under ~/.cache).

Our recipe where ModelOpt lets it be set: one Llama layer of the target's widths, feature layers [2, 15, 27]
(ModelOpt's [1, 14, 26]: it hooks layer outputs), our 8,192-token draft vocabulary (d2t from train/data.py's
rows by speculators/draft_vocab.py), K=5 steps weighted 0.8^j, AdamW lr 1e-3 betas 0.9,0.95 without weight
decay, 10 warm-up steps then cosine. Its own: the final norm (use_last_layernorm), the teacher's distribution
renormalised over the draft vocabulary, the target's embeddings frozen. Environment: SEED (0), TTT (5), LR
(1e-3), DTYPE (float32; bfloat16 is ModelOpt's own default), OMP_NUM_THREADS (1).
"""

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.peers import TARGET, Venv, target_folder, write_rows
from common.config import UserError

VERSION = "0.47.0"
# ModelOpt's [hf] extra asks transformers<5.15 (its deepspeed, diffusers, peft... are not needed); requests: its
# modelopt.torch.utils imports it and does not depend on it.
VENV = Venv(f"modelopt-{VERSION}", (("torch==2.13.0",), (f"nvidia-modelopt=={VERSION}", "transformers>=4.57,<5.15", "requests")))
LAYERS = (2, 15, 27)  # ours: HF hidden_states[l]; ModelOpt hooks the output of layer l - 1


def work_dir(n: int) -> Path:
    return VENV.path.parent / f"work-{n}"


def draft_vocab(rows_file: Path, out: Path, size: int) -> Path:
    """Our draft vocabulary of the train rows (the `size` most frequent trained tokens) as ModelOpt's d2t.pt."""
    import torch

    from speculators import draft_vocab as dv

    rows = json.loads(rows_file.read_text())["train"]
    ids = torch.tensor([t for r in rows for t in r[0]])
    mask = torch.tensor([m for r in rows for m in r[1]])
    vocab_size = json.loads((target_folder() / "config.json").read_text())["vocab_size"]
    d2t, _ = dv.build(dv.count_tokens(ids, mask, vocab_size), size)
    torch.save(d2t, out)
    return out


def spec(n: int, steps: int, work: Path, env: dict[str, str]) -> dict:
    get = lambda key, default: env.get(key) or default  # noqa: E731
    return {"target": str(target_folder()), "rows": str(work / "rows.json"), "d2t": str(work / "d2t.pt"),
            "out": str(work / "modelopt"), "steps": steps, "batch_size": 4, "seq_len": int(get("SEQ_LEN", "512")),
            "lr": float(get("LR", "1e-3")), "betas": [0.9, 0.95], "warmup": 10, "ttt": int(get("TTT", "5")),
            "decay": 0.8, "layers": [layer - 1 for layer in LAYERS], "draft_vocab": int(get("DRAFT_VOCAB", "8192")),
            "seed": int(get("SEED", "0")), "dtype": get("DTYPE", "float32")}


def run(n: int, steps: int, out: Path, work: Path | None = None, env: dict[str, str] | None = None) -> Path:
    from speculators import export

    env = dict(os.environ) | (env or {})
    threads = int(env.get("OMP_NUM_THREADS") or 1)
    work = work or work_dir(n)
    VENV.ensure()
    work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    if not (work / "rows.json").is_file():
        print(json.dumps(write_rows(n, int(env.get("SEQ_LEN") or 512), work / "rows.json", target_folder())), flush=True)
    s = spec(n, steps, work, env)
    draft_vocab(work / "rows.json", work / "d2t.pt", s["draft_vocab"])
    (work / "spec.json").write_text(json.dumps(s, indent=1))
    rows_s, t = time.time() - t, time.time()
    print(f"== ModelOpt EAGLE-3: {steps} steps", flush=True)
    VENV.run("modelopt_worker.py", [str(work / "spec.json")], threads)
    if not (work / "modelopt" / "config.json").is_file():
        raise UserError(f"ModelOpt wrote no export in {work / 'modelopt'}")
    export.convert(work / "modelopt", out, "speculators", target=TARGET, overwrite=True)
    print(f"== seconds: rows {rows_s:.0f}, hidden states 0, training {time.time() - t:.0f} (OMP_NUM_THREADS={threads})\n"
          f"ModelOpt export: {work / 'modelopt'}\nproject export: {out}   "
          f"(python -m inference drafter={out} quant=gguf eval=mtbench)", flush=True)
    return out


def main(argv: list[str]) -> None:
    from common.config import exit_on_user_error

    if len(argv) not in (3, 4) or not all(a.isdigit() for a in argv[:2]):
        raise SystemExit(__doc__.split("\n\n")[1])
    exit_on_user_error(lambda: run(int(argv[0]), int(argv[1]), Path(argv[2]), Path(argv[3]) if len(argv) > 3 else None))()


if __name__ == "__main__":
    main(sys.argv[1:])
