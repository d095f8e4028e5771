"""Batch sweep: where speculation stops paying as more prompts are decoded together.

    python -m benchmarks.batch_sweep drafter=<export> [quant=gguf] [eval=mtbench eval.turns=1 eval.num_prompts=32]
        [batch_sizes=[1,2,4,8,16,32]] [max_new_tokens=64] [repeats=2] [out=DIR]

At every batch size the same prompts are decoded in batches of that size, target-only and with
the drafter, interleaved batch by batch (inference/report.py measure: the one loop behind every
report; its batch_size key is set by the sweep). Per batch size: throughput (tokens/s of all prompts, first tokens included, median over
repeats), per-token latency p50 / p95 / p99 (engine.Stats.token_latencies_s; medians over repeats)
and tau, both ways. The crossover is the smallest batch size from which on speculation's
throughput stays below target-only's. Writes <out>/batch_sweep.json and batch_sweep.png.
"""

import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks.tables import write_result
from common import plots
from common.config import PROJECT_ROOT, at_least, exit_on_user_error, require, run_cli, to_dataclass
from forge_kernels.provenance import git_revision, machine
from inference import evalsets, report
from inference.drafting import serving_k


@dataclass
class BatchSweepConfig(report.InferenceConfig):
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    repeats: int = 2

    def __post_init__(self):
        super().__post_init__()
        require(bool(self.batch_sizes) and all(b >= 1 for b in self.batch_sizes), "batch_sizes", self.batch_sizes,
                "a non-empty list of batch sizes >= 1")
        require(self.drafting.mode == "chain", "drafting.mode", self.drafting.mode, "chain (batches draft chains)")
        at_least(1, repeats=self.repeats)


def sweep(target, drafter, prompts: list[evalsets.Prompt], cfg: BatchSweepConfig) -> dict:
    k = serving_k(drafter, cfg.k)
    runs = {size: [] for size in cfg.batch_sizes}
    for repeat in range(cfg.repeats):
        for size in cfg.batch_sizes:
            measured = report.measure(target, drafter, prompts, replace(cfg, batch_size=size, k=k))
            runs[size].append(measured)
            print(f"repeat {repeat + 1}/{cfg.repeats}, batch size {size}: {measured['tokens_per_second']:.1f} tokens/s "
                  f"speculative, {measured['baseline_tokens_per_second']:.1f} target-only", flush=True)
    rows = [row(size, measured) for size, measured in runs.items()]
    return {"rows": rows, "crossover_batch_size": crossover(rows),
            "num_prompts": len(prompts), "k": k, "config": asdict(cfg),
            "target": target.name_or_path, "git_revision": git_revision(), "machine": machine()}


def crossover(rows: list[dict]) -> int | None:
    """The smallest batch size from which on speculation is slower than target-only; None if it never is."""
    found = None
    for r in sorted(rows, key=lambda r: -r["batch_size"]):
        if r["speedup"] >= 1:
            break
        found = r["batch_size"]
    return found


def row(size: int, measured: list[dict]) -> dict:
    """One batch size's figures: medians of the repeats' throughputs, latency percentiles over all of them."""
    def median(key: str) -> float:
        return statistics.median(m[key] for m in measured)

    def latencies(key: str) -> dict:
        return {p: statistics.median(m[key][p] for m in measured) for p in ("p50", "p95", "p99")}

    speculative, baseline = median("tokens_per_second"), median("baseline_tokens_per_second")
    return {"batch_size": size, "tokens_per_second": speculative, "baseline_tokens_per_second": baseline,
            "speedup": speculative / baseline, "acceptance_length": median("acceptance_length"),
            "token_latency_ms": latencies("token_latency_ms"),
            "baseline_token_latency_ms": latencies("baseline_token_latency_ms"),
            "outputs_match_baseline": all(m["outputs_match_baseline"] is not False for m in measured),
            "tokens_per_second_repeats": [m["tokens_per_second"] for m in measured],
            "baseline_tokens_per_second_repeats": [m["baseline_tokens_per_second"] for m in measured]}


def markdown(result: dict) -> str:
    lines = [f"{result['num_prompts']} prompts, {result['config']['max_new_tokens']} new tokens each, greedy, "
             f"{result['k']}-token chains; medians of {result['config']['repeats']} interleaved "
             f"repeats; torch {result['machine']['torch']}, {result['machine']['torch_threads']} thread(s).", "",
             "| batch | tokens/s target-only | tokens/s speculative | speed-up | tau | per-token ms p50 / p95 / p99 "
             "target-only | speculative |", "|--:|--:|--:|--:|--:|--:|--:|"]
    for r in result["rows"]:
        base, spec = r["baseline_token_latency_ms"], r["token_latency_ms"]
        lines.append(f"| {r['batch_size']} | {r['baseline_tokens_per_second']:.1f} | {r['tokens_per_second']:.1f} "
                     f"| {r['speedup']:.2f}x | {r['acceptance_length']:.2f} "
                     f"| {base['p50']:.0f} / {base['p95']:.0f} / {base['p99']:.0f} "
                     f"| {spec['p50']:.0f} / {spec['p95']:.0f} / {spec['p99']:.0f} |")
    at, smallest = result["crossover_batch_size"], min(r["batch_size"] for r in result["rows"])
    lines += ["", "Speculation pays at every batch size measured." if at is None else
              "Speculation pays at none of the batch sizes measured." if at == smallest else
              f"Speculation stops paying at batch size {at}."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    sizes = [r["batch_size"] for r in result["rows"]]
    with plots.figure(path, (9, 3.5), ncols=2) as (left, right):
        for key, label in (("baseline_tokens_per_second", "target-only"), ("tokens_per_second", "speculative")):
            left.plot(sizes, [r[key] for r in result["rows"]], marker="o", label=label)
        left.set(ylabel="tokens/s (all prompts)")
        for key, label, color in (("baseline_token_latency_ms", "target-only", "tab:blue"),
                                  ("token_latency_ms", "speculative", "tab:orange")):
            right.plot(sizes, [r[key]["p50"] for r in result["rows"]], marker="o", color=color, label=f"{label} p50")
            right.plot(sizes, [r[key]["p99"] for r in result["rows"]], marker="x", linestyle="--", color=color,
                       label=f"{label} p99")
        right.set(ylabel="per-token latency (ms)")
        for ax in (left, right):
            ax.set(xscale="log", xlabel="batch size", xticks=sizes, xticklabels=sizes)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="batch_sweep", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(BatchSweepConfig, cfg)
    drafter, target = report.load_pair(cfg.drafter, cfg.target, cfg.quant, cfg.drafter_quant)
    result = sweep(target, drafter, evalsets.prompts(cfg.eval, target, cfg.max_new_tokens), cfg)
    write_result(Path(cfg.out or HydraConfig.get().runtime.output_dir), result, markdown(result), "batch_sweep.json",
                 "batch_sweep.md", lambda path: plot(result, path))


if __name__ == "__main__":
    run_cli(main)
