"""Peak memory and time of the chunked distillation loss against the naive one, on the CPU.

    python -m forge_kernels.bench_loss out=results/pycode/bench_loss.json      # the loss alone, full size
    python -m forge_kernels.bench_loss out=results/pycode/bench_loss_lm_head.json hidden=4096 repeats=3

One measurement = forward and backward of the loss on fresh [tokens, draft_vocab] draft logits
and [tokens, target_vocab] target logits (allocated before it, not counted), ending with the
gradient of the draft logits. With hidden=H the measurement starts one step earlier, at the
drafter's lm_head: draft logits = hidden [tokens, H] @ weight [draft_vocab, H]^T, and ends
with the gradients of hidden and weight; that matmul is the same in both paths.

Peak memory is the process's peak resident set size (VmHWM) during the measurement minus its
resident size (VmRSS) just before; the peak is reset with /proc/self/clear_refs (Linux). It
counts every page the step newly touched, including the freed temporaries of the autograd
graph: glibc gives each allocation above 32 MiB its own mapping, so all [tokens, vocab]
tensors are counted in full; smaller ones (the chunked path's temporaries, about 1 MiB each)
may reuse heap pages that were already resident and then go uncounted. Naive and chunked runs
alternate, `repeats` times each; the JSON holds every run and the medians, with the shapes,
git revision and machine.
"""

import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING

from common.config import at_least, one_of, run_command
from forge_kernels.distill import CHUNK_ELEMENTS, distill_loss_chunked, distill_loss_reference
from forge_kernels.provenance import git_revision, machine

IMPLEMENTATIONS = {"naive": distill_loss_reference, "chunked": distill_loss_chunked}
FULL_SIZE = (2048, 32000, 128256)  # the realistic (tokens, draft vocab, target vocab): Llama-3 8B class


def memory_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(fn, *args):
    """(seconds, peak bytes above the resident size before, result) of fn(*args)."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current size
    before = memory_kib("VmRSS")
    started = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - started
    return seconds, (memory_kib("VmHWM") - before) * 1024, result


def make_inputs(args, generator):
    """Draft logits (or lm_head inputs), target logits, draft_to_target and mask, as training sees them."""
    N, D, V = args.tokens, args.draft_vocab, args.target_vocab
    target = torch.randn(N, V, generator=generator).mul_(3).to(getattr(torch, args.target_dtype))
    draft_to_target = torch.randperm(V, generator=generator)[:D].sort().values
    mask = torch.rand(N, generator=generator) < 0.9
    if args.hidden:
        hidden = torch.randn(N, args.hidden, generator=generator).requires_grad_()
        weight = torch.randn(D, args.hidden, generator=generator).div_(args.hidden**0.5).requires_grad_()
        return (hidden, weight), target, draft_to_target, mask
    return (torch.randn(N, D, generator=generator).mul_(3).requires_grad_(),), target, draft_to_target, mask


def step(loss_fn, leaves, target, draft_to_target, mask, kind):
    """Forward + backward of the mean loss over the masked positions: [loss, *gradients of leaves]."""
    logits = leaves[0] @ leaves[1].T if len(leaves) == 2 else leaves[0]
    loss = loss_fn(logits, target, draft_to_target, mask, kind=kind)
    return [loss.detach(), *torch.autograd.grad(loss.sum() / mask.sum(), leaves)]


@dataclass
class BenchLossConfig:
    """conf/kernels/bench_loss.yaml."""

    out: str = MISSING  # the JSON file to write
    tokens: int = FULL_SIZE[0]
    draft_vocab: int = FULL_SIZE[1]
    target_vocab: int = FULL_SIZE[2]
    hidden: int = 0  # include the drafter's lm_head of this width (0: the loss alone)
    target_dtype: str = "float32"  # float32 | bfloat16
    kind: str = "soft_ce"  # soft_ce | kl
    repeats: int = 5


def bench(args: BenchLossConfig) -> dict:
    one_of("target_dtype", args.target_dtype, ("float32", "bfloat16"))
    one_of("kind", args.kind, ("soft_ce", "kl"))
    at_least(1, tokens=args.tokens, draft_vocab=args.draft_vocab, target_vocab=args.target_vocab, repeats=args.repeats)
    at_least(0, hidden=args.hidden)

    generator = torch.Generator().manual_seed(0)
    leaves, target, draft_to_target, mask = make_inputs(args, generator)
    outputs, runs = {}, {name: [] for name in IMPLEMENTATIONS}
    for _ in range(args.repeats):
        for name, loss_fn in IMPLEMENTATIONS.items():  # interleaved: naive, chunked, naive, ...
            outputs.pop(name, None)  # free the last run's gradients first
            seconds, peak, outputs[name] = measure(step, loss_fn, leaves, target, draft_to_target, mask, args.kind)
            runs[name].append({"seconds": seconds, "peak_bytes": peak})
    summary = {name: {"median_seconds": statistics.median(r["seconds"] for r in rs),
                      "median_peak_bytes": statistics.median(r["peak_bytes"] for r in rs)} for name, rs in runs.items()}
    naive, chunked = summary["naive"], summary["chunked"]
    N, D = args.tokens, args.draft_vocab
    result = {
        "shape": {"tokens": N, "draft_vocab": D, "target_vocab": args.target_vocab, "hidden": args.hidden or None,
                  "target_dtype": args.target_dtype, "draft_dtype": "float32"},
        "full_size": (N, D, args.target_vocab) == FULL_SIZE,  # False: scaled down from FULL_SIZE
        "kind": args.kind, "repeats": args.repeats, "chunk_positions": max(1, CHUNK_ELEMENTS // D),
        "measured": "forward + backward from " + ("the lm_head input" if args.hidden else "the draft logits"),
        "peak_memory_method": "VmHWM - VmRSS before, VmHWM reset via /proc/self/clear_refs",
        "one_fp32_tokens_x_draft_vocab_bytes": N * D * 4,
        "runs": runs, "median": summary,
        "peak_ratio_chunked_over_naive": chunked["median_peak_bytes"] / naive["median_peak_bytes"],
        "time_ratio_chunked_over_naive": chunked["median_seconds"] / naive["median_seconds"],
        "max_abs_diff": [float((a - b).abs().max()) for a, b in zip(outputs["naive"], outputs["chunked"])],
        "git": git_revision(), "machine": machine(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return result


def print_table(result: dict) -> None:
    s = result["shape"]
    print(f"tokens {s['tokens']}, draft vocab {s['draft_vocab']}, target vocab {s['target_vocab']}, hidden "
          f"{s['hidden'] or '- (loss alone)'}, target {s['target_dtype']}, {result['kind']}, "
          f"median of {result['repeats']}")
    print(f"{'':10}{'time (s)':>10}{'peak (MiB)':>12}")
    for name, m in result["median"].items():
        print(f"{name:10}{m['median_seconds']:10.2f}{m['median_peak_bytes'] / 2**20:12.0f}")
    print(f"chunked / naive: time {result['time_ratio_chunked_over_naive']:.2f}, "
          f"peak memory {result['peak_ratio_chunked_over_naive']:.2f}; max |naive - chunked| of the loss, "
          f"then each gradient: {', '.join(f'{d:.1e}' for d in result['max_abs_diff'])}")



def main(argv: list[str] | None = None) -> None:
    """The command; `argv` (tests) stands for the command line's overrides."""
    if argv is not None:
        sys.argv[1:] = argv
    run_command("bench_loss", BenchLossConfig, bench, config_dir="conf/kernels")


if __name__ == "__main__":
    main()
