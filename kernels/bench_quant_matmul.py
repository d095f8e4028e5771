"""Time of one quantized matmul on the CPU: the kernel against dequantize + matmul and against fp32.

    python -m forge_kernels.bench_quant_matmul out=results/pycode/quant_matmul_cpu.json [repeats=15]
        [shapes='["smollm2 lm_head",...]'] [rows=[1,6]] [stream=true]

For each layer shape (the shipped target's MLP, a 369M Llama's: hidden 2048, MLP 5632, and
SmolLM2-135M's: hidden 576, 3 KV heads of 64, MLP 1536, vocab 49152) and each number of rows of x
(1: decoding; 6: verifying 5 drafts; up to training-sized batches), these ways compute x W^T: fp32
F.linear on the unquantized W, and for int8 (per channel), int8/32 (one scale per 32 columns, GGUF's
Q8_0) and int4 (groups of 32, GGUF's Q4_1) kernels.quant_matmul's CPU kernel with fp32 x ("kernel"),
the same kernel with x rounded to int8 per 32 columns ("kernel int8-x": integer dot products, in the
instruction set the JSON names), and the reference (dequantize + one matmul; "dequantize torch": with
PyTorch's expression in place of dequantize_cpu.cpp's one pass); and the same kernel's
loop over the fp32 W ("fp32 kernel", kernels.dense_matmul: where it beats F.linear is the measurement
behind DENSE_KERNEL_MAX_ROWS). On an AVX-512 CPU, where the fp32, int4 and int8/32 kernels run AVX-512 tiles,
also their AVX2 loops ("fp32 kernel avx2", "int4 kernel avx2", "int8/32 kernel avx2")
for comparison. With against=<git revision>, also the kernel as it was at that revision ("<scheme> kernel
@<revision>"), built beside this one under another op namespace: a kernel change measured against its baseline
in the same process, call by call, with whether both give the same bits.
Ways alternate call by call within each repeat (the same machine load for all); each timing is
enough calls to last about 20 ms, and the JSON holds the median milliseconds per call over
repeats, the speed-up over fp32, and per scheme the largest row count where the kernel still
beats dequantize + matmul: the measurement behind kernels.quant_matmul.CPU_KERNEL_MAX_ROWS.
The weights stay in the caches between calls unless stream=true, where each call reads another copy from
memory, as decoding a whole model does (1 GiB of copies: more than a 480 MB L3, as one machine here has).
"""

import functools
import itertools
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import MISSING

from common.config import PROJECT_ROOT, UserError, at_least, one_of, run_command
from forge_kernels.build import extensions_root, load_library
from forge_kernels.provenance import git_revision, machine
from forge_kernels.quant_matmul import (
    CPU_KERNEL_BUILD,
    CPU_KERNEL_MAX_ROWS,
    cpu_ops,
    dense_kernel_max_rows,
    dequantize_torch,
    pack_int4,
    quant_matmul_cpu,
    quant_matmul_reference,
    round_to_nearest_int4,
)

SHAPES = {"pycode mlp up": (768, 256), "pycode mlp down": (256, 768),
          "369M mlp up": (5632, 2048), "369M mlp down": (2048, 5632),
          "smollm2 attn q/o": (576, 576), "smollm2 attn k/v": (192, 576), "smollm2 mlp gate/up": (1536, 576),
          "smollm2 mlp down": (576, 1536), "smollm2 lm_head": (49152, 576)}  # name -> (N, K)
ROWS = (1, 6, 16, 32, 64, 128)
GROUP_SIZE = 32
SCHEMES = ("int8", "int8/32", "int4")
STREAM_BYTES = 2**30


def ways_for(N: int, K: int, stream: bool = False, against: str | None = None) -> dict:
    """way name -> function of x, all computing x W^T for a random W. stream: each call takes the next of
    enough copies of W (1 GiB of fp32) that none is still in a cache, as in decoding a whole model."""
    copies = -(-STREAM_BYTES // (4 * N * K)) if stream else 1
    stored = [stored_forms(torch.randn(N, K)) for _ in range(copies)]
    turn = itertools.cycle(range(copies))

    def way(fn):
        return lambda x: fn(x, stored[next(turn)])

    ways = {"fp32": way(lambda x, w: F.linear(x, w["fp32"])),
            "fp32 kernel": way(lambda x, w: cpu_ops().fp32_matmul(x, w["fp32"]))}
    for scheme in SCHEMES:
        ways |= {f"{scheme} kernel": way(lambda x, w, s=scheme: quant_matmul_cpu(x, *w[s])),
                 f"{scheme} kernel int8-x": way(lambda x, w, s=scheme: quant_matmul_cpu(x, *w[s], int8_activations=True)),
                 f"{scheme} dequantize": way(lambda x, w, s=scheme: quant_matmul_reference(x, *w[s])),
                 f"{scheme} dequantize torch": way(lambda x, w, s=scheme: x @ dequantize_torch(*w[s]).T)}
    if cpu_ops().fp32_x_isa("") == "avx512":
        ways["fp32 kernel avx2"] = way(in_avx2(lambda x, w: cpu_ops().fp32_matmul(x, w["fp32"])))
        ways |= {f"{scheme} kernel avx2": way(in_avx2(lambda x, w, s=scheme: quant_matmul_cpu(x, *w[s])))
                 for scheme in ("int4", "int8/32")}
    if against:
        ops = revision_ops(against)
        ways |= {f"fp32 kernel @{against}": way(lambda x, w: ops.fp32_matmul(x, w["fp32"])),
                 f"int8 kernel @{against}": way(lambda x, w: ops.int8_matmul(x, *w["int8"])),
                 f"int8/32 kernel @{against}": way(lambda x, w: ops.int8_group_matmul(x, *w["int8/32"][:2], GROUP_SIZE)),
                 f"int4 kernel @{against}": way(lambda x, w: ops.int4_matmul(x, *w["int4"]))}
    return ways


@functools.cache
def revision_ops(revision: str):
    """torch.ops of kernels/quant_matmul_cpu.cpp as it was at a git revision, built beside today's kernel
    under the namespace speculators_forge_<revision> (two libraries cannot define the same ops)."""
    show = subprocess.run(["git", "show", f"{revision}:kernels/quant_matmul_cpu.cpp"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True)
    if show.returncode:
        raise UserError(f"against={revision}: no kernels/quant_matmul_cpu.cpp at that revision of {PROJECT_ROOT} "
                        f"({show.stderr.strip().splitlines()[0] if show.stderr.strip() else 'git failed'})")
    namespace = "speculators_forge_" + re.sub(r"\W", "_", revision)
    source = extensions_root() / f"{namespace}.cpp"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(show.stdout.replace("speculators_forge", namespace))
    load_library(f"{namespace}_cpu", (source,), *CPU_KERNEL_BUILD[2:], purpose=f"the kernel at {revision}")
    return getattr(torch.ops, namespace)


def in_avx2(matmul):
    """matmul run in the AVX2 loops of the kernels that multiply fp32 x (on an AVX-512 CPU, for comparison)."""
    def run(x, w):
        cpu_ops().fp32_x_isa("avx2")
        try:
            return matmul(x, w)
        finally:
            cpu_ops().fp32_x_isa("best")
    return run


def stored_forms(weight: torch.Tensor) -> dict:
    """scheme -> the stored operands of quant_matmul for `weight`, and "fp32" -> weight."""
    N = weight.shape[0]
    scales8 = weight.abs().amax(1) / 127
    scales8g = weight.view(N, -1, GROUP_SIZE).abs().amax(-1) / 127
    q, scales4, zeros4 = round_to_nearest_int4(weight, GROUP_SIZE)
    return {"fp32": weight, "int8": (torch.round(weight / scales8[:, None]).to(torch.int8), scales8),
            "int8/32": (torch.round(weight / scales8g.repeat_interleave(GROUP_SIZE, 1)).to(torch.int8), scales8g, None,
                        GROUP_SIZE),
            "int4": (pack_int4(q), scales4, zeros4, GROUP_SIZE)}


def against_revision(revision: str, N: int, K: int, by_rows: dict[int, dict[str, float]]) -> dict:
    """rows -> per kernel: its speed-up over the revision's, and whether both give the same bits."""
    w, ops = stored_forms(torch.randn(N, K)), revision_ops(revision)
    now = {"fp32": lambda x: cpu_ops().fp32_matmul(x, w["fp32"]), **{s: lambda x, s=s: quant_matmul_cpu(x, *w[s]) for s in SCHEMES}}
    then = {"fp32": lambda x: ops.fp32_matmul(x, w["fp32"]), "int8": lambda x: ops.int8_matmul(x, *w["int8"]),
            "int8/32": lambda x: ops.int8_group_matmul(x, *w["int8/32"][:2], GROUP_SIZE),
            "int4": lambda x: ops.int4_matmul(x, *w["int4"])}
    result = {}
    for rows, ms in by_rows.items():
        x = torch.randn(rows, K)
        result[rows] = {"speedup": {s: round(ms[f"{s} kernel @{revision}"] / ms[f"{s} kernel"], 3) for s in now},
                        "same_bits": {s: torch.equal(now[s](x), then[s](x)) for s in now}}
    return result


def calls_lasting(fn, x, seconds: float = 0.02) -> int:
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        fn(x)
        calls += 1
    return calls


def time_shape(N: int, K: int, rows: int, repeats: int, stream: bool = False,
               against: str | None = None) -> dict[str, float]:
    """way -> median ms per call."""
    ways = ways_for(N, K, stream, against)
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


def wins_up_to(by_rows: dict[int, dict[str, float]], way: str, against: str) -> int:
    """The largest row count up to which `way` beats `against` at every measured count."""
    best = 0
    for rows, ms in sorted(by_rows.items()):
        if ms[way] >= ms[against]:
            break
        best = rows
    return best


@dataclass
class BenchQuantMatmulConfig:
    """conf/kernels/bench_quant_matmul.yaml."""

    out: str = MISSING  # the JSON file to write
    repeats: int = 15
    shapes: list[str] | None = None  # SHAPES' names; None: all
    rows: list[int] | None = None  # rows of x; None: ROWS
    stream: bool = False  # weights from memory, not from the caches
    against: str | None = None  # a git revision: also its kernel, alternating call by call with this one


def bench(args: BenchQuantMatmulConfig) -> None:
    args.shapes = list(SHAPES) if args.shapes is None else args.shapes
    args.rows = list(ROWS) if args.rows is None else args.rows
    for name in args.shapes:
        one_of("shapes", name, list(SHAPES))
    at_least(1, repeats=args.repeats, rows=min(args.rows, default=0))
    out = Path(args.out)
    if cpu_ops() is None:
        raise SystemExit("error: the CPU kernel is not available here (needs AVX2 and a C++ compiler)")
    shapes = {}
    for name in args.shapes:
        N, K = SHAPES[name]
        by_rows = {rows: time_shape(N, K, rows, args.repeats, args.stream, args.against) for rows in args.rows}
        shapes[name] = {"N": N, "K": K,
                        "ms_per_call": {rows: {w: round(ms, 4) for w, ms in r.items()} for rows, r in by_rows.items()},
                        "speedup_over_fp32": {rows: {w: round(r["fp32"] / ms, 2) for w, ms in r.items() if w != "fp32"}
                                              for rows, r in by_rows.items()},
                        "kernel_beats_dequantize_up_to_rows": {f"{s} {k}": wins_up_to(by_rows, f"{s} {k}", f"{s} dequantize")
                                                               for s in SCHEMES for k in ("kernel", "kernel int8-x")},
                        "fp32_kernel_beats_fp32_up_to_rows": wins_up_to(by_rows, "fp32 kernel", "fp32")}
        if args.against:
            shapes[name][f"against {args.against}"] = against_revision(args.against, N, K, by_rows)
            print(name, f"against {args.against}:", json.dumps(shapes[name][f"against {args.against}"]))
        print(name, json.dumps(shapes[name]["speedup_over_fp32"]), shapes[name]["kernel_beats_dequantize_up_to_rows"],
              "fp32 kernel beats F.linear up to", shapes[name]["fp32_kernel_beats_fp32_up_to_rows"], "rows")
    shape_names = ",".join(f'"{name}"' for name in args.shapes)
    result = {"command": shlex.join(["python", "-m", "forge_kernels.bench_quant_matmul", f"out={out}", f"repeats={args.repeats}",
                                     f"shapes=[{shape_names}]", f"rows=[{','.join(map(str, args.rows))}]"]
                                    + (["stream=true"] if args.stream else [])
                                    + ([f"against={args.against}"] if args.against else [])),
              "git_revision": git_revision(), "machine": machine(), "int8_dot_isa": cpu_ops().int8_dot_isa(""),
              "fp32_x_isa": cpu_ops().fp32_x_isa(""),
              "group_size": GROUP_SIZE, "cpu_kernel_max_rows": CPU_KERNEL_MAX_ROWS,
              "dense_kernel_max_rows": dense_kernel_max_rows(), "shapes": shapes}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """The command; `argv` (tests) stands for the command line's overrides."""
    if argv is not None:
        sys.argv[1:] = argv
    run_command("bench_quant_matmul", BenchQuantMatmulConfig, bench, config_dir="conf/kernels")


if __name__ == "__main__":
    main()
