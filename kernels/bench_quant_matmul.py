"""Time of one quantized matmul on the CPU: the kernel against dequantize + matmul and against fp32.

    python -m kernels.bench_quant_matmul kernels/results/quant_matmul_cpu.json [--repeats 15]

For each layer shape (the shipped target's MLP, and a 369M Llama's: hidden 2048, MLP 5632) and
each number of rows of x (1: decoding; 6: verifying 5 drafts; up to training-sized batches),
five ways compute x W^T: fp32 F.linear on the unquantized W, and for int8 (per channel) and int4
(groups of 32) kernels.quant_matmul's CPU kernel and its reference (dequantize + one matmul).
Ways alternate call by call within each repeat (the same machine load for all); each timing is
enough calls to last about 20 ms, and the JSON holds the median milliseconds per call over
repeats, the speed-up over fp32, and per scheme the largest row count where the kernel still
beats dequantize + matmul: the measurement behind kernels.quant_matmul.CPU_KERNEL_MAX_ROWS.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from inference.report import git_revision, machine
from kernels.quant_matmul import (
    CPU_KERNEL_MAX_ROWS,
    cpu_ops,
    pack_int4,
    quant_matmul_cpu,
    quant_matmul_reference,
)
from speculators.quant import round_to_nearest_int4

SHAPES = {"pycode mlp up": (768, 256), "pycode mlp down": (256, 768),
          "369M mlp up": (5632, 2048), "369M mlp down": (2048, 5632)}  # name -> (N, K)
ROWS = (1, 6, 16, 32, 64, 128)
GROUP_SIZE = 32


def ways_for(N: int, K: int) -> dict:
    """way name -> function of x, all computing x W^T for one random W."""
    weight = torch.randn(N, K)
    scales8 = weight.abs().amax(1) / 127
    int8 = (torch.round(weight / scales8[:, None]).to(torch.int8), scales8)
    q, scales4, zeros4 = round_to_nearest_int4(weight, GROUP_SIZE)
    int4 = (pack_int4(q), scales4, zeros4, GROUP_SIZE)
    return {"fp32": lambda x: F.linear(x, weight),
            "int8 kernel": lambda x: quant_matmul_cpu(x, *int8),
            "int8 dequantize": lambda x: quant_matmul_reference(x, *int8),
            "int4 kernel": lambda x: quant_matmul_cpu(x, *int4),
            "int4 dequantize": lambda x: quant_matmul_reference(x, *int4)}


def calls_lasting(fn, x, seconds: float = 0.02) -> int:
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        fn(x)
        calls += 1
    return calls


def time_shape(N: int, K: int, rows: int, repeats: int) -> dict[str, float]:
    """way -> median ms per call."""
    ways = ways_for(N, K)
    x = torch.randn(rows, K)
    calls = {name: calls_lasting(fn, x) for name, fn in ways.items()}  # also the warm-up
    times = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            started = time.perf_counter()
            for _ in range(calls[name]):
                fn(x)
            times[name].append(1e3 * (time.perf_counter() - started) / calls[name])
    return {name: statistics.median(ms) for name, ms in times.items()}


def kernel_wins_up_to(by_rows: dict[int, dict[str, float]], scheme: str) -> int:
    """The largest row count up to which the kernel beats dequantize + matmul at every measured count."""
    best = 0
    for rows, ms in sorted(by_rows.items()):
        if ms[f"{scheme} kernel"] >= ms[f"{scheme} dequantize"]:
            break
        best = rows
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if cpu_ops() is None:
        raise SystemExit("error: the CPU kernel is not available here (needs AVX2 and a C++ compiler)")
    shapes = {}
    for name, (N, K) in SHAPES.items():
        by_rows = {rows: time_shape(N, K, rows, args.repeats) for rows in ROWS}
        shapes[name] = {"N": N, "K": K,
                        "ms_per_call": {rows: {w: round(ms, 4) for w, ms in r.items()} for rows, r in by_rows.items()},
                        "speedup_over_fp32": {rows: {w: round(r["fp32"] / ms, 2) for w, ms in r.items() if w != "fp32"}
                                              for rows, r in by_rows.items()},
                        "kernel_beats_dequantize_up_to_rows": {s: kernel_wins_up_to(by_rows, s) for s in ("int8", "int4")}}
        print(name, json.dumps(shapes[name]["speedup_over_fp32"]), shapes[name]["kernel_beats_dequantize_up_to_rows"])
    result = {"command": f"python -m kernels.bench_quant_matmul {args.out} --repeats {args.repeats}",
              "git_revision": git_revision(), "machine": machine(),
              "group_size": GROUP_SIZE, "cpu_kernel_max_rows": CPU_KERNEL_MAX_ROWS, "shapes": shapes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
