"""The drafter's linear layers at serving precision: what quantizing them (drafter_quant) does to tau and speed.

    python -m benchmarks.drafter_quant drafter=<export> [quant=gguf] [eval=mtbench eval.num_prompts=6]
        [schemes=[none,int8,int4]] [k=1] [max_new_tokens=64] [repeats=2] [out=DIR]

Each scheme is an arm of one report loop (inference/report.py measure_arms): every prompt decoded target-only,
then with the drafter at each precision, interleaved prompt by prompt, so all arms see the same machine load
and the same target outputs. Per scheme, medians over repeats of tokens/s, speed-up and the drafter's share of
decoding time (time_split_s's draft), and tau (the same every repeat: greedy). Writes <out>/drafter_quant.json
and drafter_quant.md.
"""

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks.tables import write_result
from common.config import PROJECT_ROOT, at_least, exit_on_user_error, require, run_cli, to_dataclass
from forge_kernels.provenance import git_revision, machine
from inference import evalsets, report
from speculators.quant import quantized_linears


@dataclass
class DrafterQuantConfig(report.InferenceConfig):
    schemes: list[str] = field(default_factory=lambda: ["none", "int8", "int4"])
    repeats: int = 2

    def __post_init__(self):
        super().__post_init__()
        require(bool(self.schemes), "schemes", self.schemes, "a non-empty list, e.g. [none,int8]")
        require(self.drafter_quant is None, "drafter_quant", self.drafter_quant, "null (schemes lists the arms)")
        at_least(1, repeats=self.repeats)


def measure(target, drafter, prompts: list[evalsets.Prompt], cfg: DrafterQuantConfig) -> dict:
    arms = {scheme: (quantized_linears(drafter, scheme), cfg.k) for scheme in cfg.schemes}
    runs = [report.measure_arms(target, arms, prompts, cfg) for _ in range(cfg.repeats)]

    def median(scheme: str, figure) -> float:
        return statistics.median(figure(run[scheme]) for run in runs)

    rows = [{"scheme": scheme, "drafter_linears": runs[0][scheme]["drafter_linears"],
             "k": runs[0][scheme]["config"]["k"], "acceptance_length": median(scheme, lambda r: r["acceptance_length"]),
             "speedup": median(scheme, lambda r: r["speedup"]),
             "tokens_per_second": median(scheme, lambda r: r["tokens_per_second"]),
             "baseline_tokens_per_second": median(scheme, lambda r: r["baseline_tokens_per_second"]),
             "draft_s": median(scheme, lambda r: r["time_split_s"]["draft"]),
             "verify_s": median(scheme, lambda r: r["time_split_s"]["verify"]),
             "outputs_match_baseline": all(run[scheme]["outputs_match_baseline"] is not False for run in runs),
             "speedup_repeats": [run[scheme]["speedup"] for run in runs]} for scheme in cfg.schemes]
    return {"rows": rows, "num_prompts": len(prompts), "config": asdict(cfg), "target": target.name_or_path,
            "git_revision": git_revision(), "machine": machine()}


def markdown(result: dict) -> str:
    lines = [f"{result['num_prompts']} prompts, {result['config']['max_new_tokens']} new tokens, greedy; medians of "
             f"{result['config']['repeats']} interleaved repeats; {result['machine']['torch_threads']} thread(s).", "",
             "| drafter's linears | K | tau | speed-up | tokens/s | target-only | drafter s | verify s "
             "| outputs identical |",
             "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
    lines += [f"| {r['drafter_linears']} | {r['k']} | {r['acceptance_length']:.3f} | {r['speedup']:.3f}x | "
              f"{r['tokens_per_second']:.1f} | {r['baseline_tokens_per_second']:.1f} | {r['draft_s']:.2f} | "
              f"{r['verify_s']:.2f} | {'yes' if r['outputs_match_baseline'] else 'NO'} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="drafter_quant", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(DrafterQuantConfig, cfg)
    drafter, target = report.load_pair(cfg.drafter, cfg.target, cfg.quant, drafter_quant="none")
    result = measure(target, drafter, evalsets.prompts(cfg.eval, target, cfg.max_new_tokens), cfg)
    write_result(Path(cfg.out or HydraConfig.get().runtime.output_dir), result, markdown(result),
                 "drafter_quant.json", "drafter_quant.md")


if __name__ == "__main__":
    run_cli(main)
