"""Quantized-target benchmark: decode speed and weight memory per quantization scheme.

    python -m benchmarks.quant_bench out=OUT.json [target=DIR] [prompts=4] [new_tokens=64] [repeats=3]
                                     [all_weights=true] [decode_only=true] [ways=[none,w8a8,...]]

Target-only greedy decoding (inference.engine.generate, K=0, batch 1) of the same held-out prompts
(the stdlib eval set, inference/evalsets.py) by the target loaded once per scheme (none, int8,
int4, gptq_int4, fp8, w8a8; embeddings and lm_head kept, the defaults, or quantized too with
all_weights=true), each on the default CPU path quant.cpu_matmul=kernel, and int8 and int4 also
dequantized into one dense matmul and on PyTorch's packed operators (rows "int8/dequantize",
"int4/packed", ...): the measurement behind the default.
ways= keeps some of these rows (none, the baseline, always stays).
Beside decoding (one row per linear call), whole forward passes at the other sizes the target
runs: a verification pass (1 x 6 tokens: K=5 drafts and the root) and a training batch
(8 x 256 tokens), median milliseconds over `repeats`, interleaved the same way (decode_only=true
skips them). Schemes are interleaved prompt by prompt within each repeat, so each sees the same
machine load; tokens/s is the median over repeats of (tokens emitted) / (decode time
after the first token). Also per scheme: weight bytes, the CPU operator its linear layers use,
the quantize-dequantize relative error ||W - W_q||_F / ||W||_F over the quantized layers, and
output drift (mean length of the greedy output's prefix equal to the unquantized target's).

The pieces here (interleaved decoding, the error, the operators) also serve benchmarks.quant_report.
"""

import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING

from benchmarks import rounds
from common.config import PROJECT_ROOT, at_least, require, run_command
from forge_kernels.provenance import git_revision, machine
from inference import evalsets
from inference.drafting import DraftingConfig
from inference.engine import Stats, generate
from inference.evalsets import EvalConfig
from speculators.quant import QUANT_SCHEMES, QuantConfig, QuantizedEmbedding, QuantizedLinear, weight_bytes
from speculators.target import FrozenTarget, TargetConfig


@dataclass
class Decoded:
    """One way of decoding over every prompt: tokens/s of each round; outputs and counters of the first."""

    tokens_per_s: list[float]
    outputs: list[list[int]]
    stats: Stats


def decode_ways(ways: dict, prompts: list[list[int]], new_tokens: int, repeats: int,
                drafting: DraftingConfig | None = None) -> dict[str, Decoded]:
    """ways: name -> (target, drafter or None, K: draft tokens per step, 0 without a drafter), greedy,
    interleaved (benchmarks.rounds). tokens/s of a round = tokens after the first / decode time after
    the first token, summed over the prompts."""
    def decode(target, drafter, k):
        return lambda ids: generate(target, drafter, ids, new_tokens, k if drafter is not None else 0, drafting=drafting)

    timed = rounds.interleaved({name: decode(*way) for name, way in ways.items()}, prompts, repeats,
                               count=lambda out, wall: (len(out.tokens) - 1, out.stats.decode_s))
    decoded = {}
    for name, (_, drafter, k) in ways.items():
        stats = Stats(k if drafter is not None else 0)
        for out in timed[name].results:
            stats.add(out.stats)
        decoded[name] = Decoded(timed[name].tokens_per_s(), [out.tokens for out in timed[name].results], stats)
    return decoded


def quant_error(full: torch.nn.Module, quantized: torch.nn.Module) -> float | None:
    """||W - W_q||_F / ||W||_F over the quantized layers of `quantized` (None if nothing is quantized)."""
    originals = dict(full.named_modules())
    pairs = [(originals[name].weight.detach().float(), m.weight) for name, m in quantized_modules(quantized)]
    if not pairs:
        return None
    return float((sum((w - q).pow(2).sum() for w, q in pairs) / sum(w.pow(2).sum() for w, _ in pairs)).sqrt())


def quantized_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """Quantized linear layers and embeddings (not the tables inside the embeddings)."""
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    embeddings = {name for name, m in modules if isinstance(m, QuantizedEmbedding)}
    return [(name, m) for name, m in modules if name.rpartition(".")[0] not in embeddings]


def linear_ops(model) -> dict[str, int]:
    """How many linear layers run through each CPU operator."""
    ops = Counter(m.cpu_op() for _, m in quantized_modules(model) if isinstance(m, QuantizedLinear))
    ops["aten.linear (full precision)"] += sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return {op: n for op, n in ops.items() if n}


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def error_of(way: str, full, target, rows: dict) -> float | None:
    """quant_error of a way's target. A packed row holds its scheme's quantized values, but reading them
    back through the operator is slow: it reuses its scheme's row (None when that row is not measured)."""
    scheme, packed, _ = way.partition("/")
    if packed:
        return rows.get(scheme, {}).get("quant_dequant_rel_error")
    return quant_error(full.model, target.model)


FORWARD_SHAPES = {"verify_1x6": (1, 6), "train_8x256": (8, 256)}


def forward_ms(targets: dict, repeats: int) -> dict[str, dict[str, float]]:
    """name -> shape -> median ms of one target forward pass over random ids of that shape."""
    times = {name: {shape: [] for shape in FORWARD_SHAPES} for name in targets}
    for _ in range(repeats):
        for shape, size in FORWARD_SHAPES.items():
            ids = torch.randint(0, next(iter(targets.values())).vocab_size, size)
            for name, target in targets.items():
                started = time.perf_counter()
                target(ids)
                times[name][shape].append(1e3 * (time.perf_counter() - started))
    return {name: {shape: statistics.median(ms) for shape, ms in row.items()} for name, row in times.items()}


def run(target_dir: str, num_prompts: int, new_tokens: int, repeats: int, all_weights: bool,
        decode_only: bool = False, chosen: list[str] | None = None) -> dict:
    options = dict(quantize_embeddings=all_weights, quantize_lm_head=all_weights)
    config = TargetConfig.named(target_dir, layer_ids=[0])  # target-only decoding: no drafter reads layers
    schemes = [s for s in QUANT_SCHEMES if s != "gguf" or config.gguf_file]  # gguf packs a GGUF file's own blocks
    ways = {scheme: QuantConfig(scheme=scheme, **options) for scheme in schemes}
    ways |= {f"{scheme}/{path}": QuantConfig(scheme=scheme, cpu_matmul=path, **options)
             for scheme in ("int8", "int4") for path in ("dequantize", "packed")}
    if chosen:
        unknown = sorted(set(chosen) - set(ways))
        require(not unknown, "--ways", ",".join(unknown), f"a comma-separated list of {', '.join(ways)}")
        ways = {name: quant for name, quant in ways.items() if name == "none" or name in chosen}
    full = FrozenTarget.load(config)
    targets = {name: FrozenTarget.load(config, quant) for name, quant in ways.items()}
    prompts = [p.ids for p in evalsets.prompts(EvalConfig("stdlib", num_prompts=num_prompts), full, new_tokens)]
    decoded = decode_ways({scheme: (target, None, 0) for scheme, target in targets.items()}, prompts, new_tokens,
                          repeats)
    forwards = {} if decode_only else forward_ms(targets, repeats)
    base = statistics.median(decoded["none"].tokens_per_s)
    rows = {}
    for scheme, target in targets.items():
        speeds = decoded[scheme].tokens_per_s
        rows[scheme] = {
            "decode_tokens_per_s": statistics.median(speeds),
            "speedup_vs_none": statistics.median(speeds) / base,
            "tokens_per_s_repeats": speeds,
            "weight_bytes": weight_bytes(target.model),
            "linear_ops": linear_ops(target.model),
            "forward_ms": forwards.get(scheme),
            "quant_dequant_rel_error": error_of(scheme, full, target, rows),
            "mean_prefix_equal_to_none": statistics.mean(
                prefix_match(a, b) for a, b in zip(decoded[scheme].outputs, decoded["none"].outputs)),
        }
    return {"schemes": rows, "config": dict(target=target_dir, prompts=num_prompts, new_tokens=new_tokens,
                                            repeats=repeats, quant_options=options, decode_only=decode_only,
                                            ways=list(ways)),
            "git_revision": git_revision(), "machine": machine()}


@dataclass
class QuantBenchConfig:
    """conf/benchmarks/quant_bench.yaml."""

    out: str = MISSING  # the JSON file for the figures
    target: str = str(PROJECT_ROOT / "models" / "pycode")
    prompts: int = 4
    new_tokens: int = 64
    repeats: int = 3
    all_weights: bool = False  # quantize the embeddings and lm_head too
    decode_only: bool = False  # skip the whole-pass timings
    ways: list[str] | None = None  # rows to measure; None: all


def bench(args: QuantBenchConfig) -> None:
    at_least(1, prompts=args.prompts, new_tokens=args.new_tokens, repeats=args.repeats)
    result = run(args.target, args.prompts, args.new_tokens, args.repeats, args.all_weights, args.decode_only,
                 args.ways)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for scheme, row in result["schemes"].items():
        print(f"{scheme:11} {row['decode_tokens_per_s']:7.1f} tok/s  x{row['speedup_vs_none']:.2f}  "
              f"{row['weight_bytes'] / 2**20:6.2f} MiB  forward ms {row['forward_ms']}  err {row['quant_dequant_rel_error']}  {row['linear_ops']}")



def main(argv: list[str] | None = None) -> None:
    """The command; `argv` (tests) stands for the command line's overrides."""
    if argv is not None:
        sys.argv[1:] = argv
    run_command("quant_bench", QuantBenchConfig, bench, config_dir="conf/benchmarks")


if __name__ == "__main__":
    main()
