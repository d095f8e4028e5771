"""Acceptance report: speculative decoding against target-only decoding on the same prompts.

Writes <out>/report.json (vLLM's metric definitions, DESIGN.md section 3), <out>/acceptance.png
(acceptance rate per draft position) and prints a table. Baseline and speculative runs are
interleaved batch by batch (`batch_size` prompts decoded together, both ways), so both see the
same machine load. The report has the same keys at every batch size.
"""

import json
import platform
import resource
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from inference.drafting import DraftingConfig
from inference.engine import Stats, check_pair, generate_batch
from speculators import corpus
from speculators.config import UserError, at_least, register_group, require
from speculators.quant import QuantConfig
from train.run import LoggerConfig, wandb_mode

register_group("quant")  # conf/quant/ of the training recipes: `python -m inference quant=int4` serves it


@dataclass
class InferenceConfig:
    drafter: str = "???"  # an export folder (vLLM speculators format)
    target: str | None = None  # None: the verifier named in the drafter's config
    quant: QuantConfig = field(default_factory=QuantConfig)  # serve the target quantized (quant=int8|int4|fp8|w8a8)
    prompts: str = "heldout"  # heldout: first lines of test-split stdlib files; or a text file, one prompt per line
    num_prompts: int = 8
    prompt_lines: int = 6
    max_new_tokens: int = 64
    temperature: float = 0.0
    num_speculative_tokens: int = 5  # chain length; tree depth with drafting.mode=tree
    drafting: DraftingConfig = field(default_factory=DraftingConfig)
    batch_size: int = 1  # prompts decoded together (chains only); 1 is the single-sequence fast path
    seed: int = 0
    out: str | None = None  # None: the Hydra run directory
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(kind="none"))  # kind=wandb to log the report

    def __post_init__(self):
        at_least(0, num_speculative_tokens=self.num_speculative_tokens, temperature=self.temperature)
        at_least(1, num_prompts=self.num_prompts, prompt_lines=self.prompt_lines, max_new_tokens=self.max_new_tokens,
                 batch_size=self.batch_size)
        if self.batch_size > 1 and self.drafting.mode == "tree":
            raise UserError(f"drafting.mode=tree decodes one prompt at a time; batch_size={self.batch_size} needs "
                            f"drafting.mode=chain (or batch_size=1)")
        require(0 <= self.seed < 2**32, "seed", self.seed, "in [0, 2**32 - 1], as for training")


def load_pair(drafter_path: str, target_path: str | None = None, quant=None):
    """(drafter, target) from an export; the target is the verifier its config names unless given."""
    from speculators import export
    from speculators.target import FrozenTarget, TargetConfig

    drafter, verifier = export.load(Path(drafter_path))
    if not (target_path or verifier):
        raise UserError(f"{drafter_path} does not name its target (original EAGLE-3 format); pass target=<path or hub id>")
    target_cfg = TargetConfig(name_or_path=target_path or verifier, layer_ids=getattr(drafter, "layer_ids", None))
    return drafter.eval(), FrozenTarget.load(target_cfg, quant or QuantConfig())


def heldout_prompts(count: int, lines: int = 6) -> list[str]:
    """The first lines of the first `count` test-split files: code no target or drafter trained on."""
    test = corpus.stdlib_files()["test"]
    return ["".join(text.splitlines(keepends=True)[:lines]) for text in test["text"][:count]]


def load_prompts(cfg: InferenceConfig) -> list[str]:
    if cfg.prompts == "heldout":
        return heldout_prompts(cfg.num_prompts, cfg.prompt_lines)
    path = Path(cfg.prompts)
    if not path.is_file():
        raise UserError(f"prompts={cfg.prompts!r}: use 'heldout' or a text file with one prompt per line")
    prompts = [line.replace("\\n", "\n") for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts")
    return prompts[: cfg.num_prompts]


def measure(target, drafter, prompts: list[str], cfg: InferenceConfig) -> dict:
    """Run baseline and speculative decoding on every prompt; return the report as a dict."""
    k = cfg.num_speculative_tokens
    if drafter is not None and k:
        check_pair(target, drafter)
    spec_total, base_total, rows, steps, base_steps = Stats(k), Stats(0), [], 0, 0
    size = cfg.batch_size
    for first in range(0, len(prompts), size):  # batch by batch; seed: that of the batch's first prompt
        texts = prompts[first : first + size]
        ids = [target.tokenizer(text)["input_ids"] for text in texts]
        base = generate_batch(target, None, ids, cfg.max_new_tokens, 0, cfg.temperature, cfg.seed + first)
        spec = generate_batch(target, drafter, ids, cfg.max_new_tokens, k, cfg.temperature, cfg.seed + first,
                              cfg.drafting)
        base_total.add(base.stats)
        spec_total.add(spec.stats)
        steps += max(map(len, spec.tokens)) - 1  # decode steps a request of the batch waits through
        base_steps += max(map(len, base.tokens)) - 1
        for text, prompt_ids, out, baseline in zip(texts, ids, spec.tokens, base.tokens):
            rows.append({"prompt": text, "prompt_ids": prompt_ids, "output_ids": out,
                         "output": target.tokenizer.decode(out), "baseline_output_ids": baseline,
                         "matches_baseline": out == baseline})
    batches = -(-len(prompts) // size)
    new_tokens = sum(len(r["output_ids"]) for r in rows)
    base_tokens = sum(len(r["baseline_output_ids"]) for r in rows)
    drafts = max(spec_total.num_drafts, 1)
    spec_speed = new_tokens / (spec_total.ttft_s + spec_total.decode_s)
    base_speed = base_tokens / (base_total.ttft_s + base_total.decode_s)
    return {
        "acceptance_length": 1 + spec_total.num_accepted_tokens / drafts,
        # Each row's own verification, before a batch cuts it to the common advance (= the above at batch 1).
        "acceptance_length_per_row": 1 + spec_total.row_accepted_tokens / drafts,
        "acceptance_rate_per_position": [a / drafts for a in spec_total.accepted_at],
        "num_drafts": spec_total.num_drafts,
        "num_draft_tokens": spec_total.num_draft_tokens,
        "num_accepted_tokens": spec_total.num_accepted_tokens,
        "target_forwards": spec_total.target_forwards,
        "baseline_target_forwards": base_total.target_forwards,
        "tokens_per_second": spec_speed,
        "baseline_tokens_per_second": base_speed,
        "speedup": spec_speed / base_speed,
        "ttft_s": spec_total.ttft_s / batches,  # every prompt of a batch waits for the batch's prefill
        "tpot_s": spec_total.decode_s / max(steps, 1),
        "baseline_tpot_s": base_total.decode_s / max(base_steps, 1),
        "time_split_s": {"draft": spec_total.draft_s, "verify": spec_total.verify_s,
                         "other": spec_total.decode_s - spec_total.draft_s - spec_total.verify_s,
                         "first_token": spec_total.ttft_s},
        "peak_memory_mb": peak_memory_mb(),
        "outputs_match_baseline": all(r["matches_baseline"] for r in rows) if cfg.temperature == 0 else None,
        "prompts": rows,
        "config": asdict(cfg),
        "target": target.name_or_path,
        "target_layer_ids": target.layer_ids,
        "git_revision": git_revision(),
        "machine": machine(),
    }


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB: the process's peak RSS


def git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write(report: dict, out_dir: Path) -> Path:
    """report.json and acceptance.png in out_dir; the table on the console."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    rates = report["acceptance_rate_per_position"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(1, len(rates) + 1), rates, marker="o")
    ax.set(xlabel="draft position i", ylabel="acceptance rate", ylim=(0, 1), xticks=range(1, len(rates) + 1),
           title=f"acceptance length tau = {report['acceptance_length']:.2f}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=120)
    plt.close(fig)
    print(table(report))
    return out_dir / "report.json"


def log_to_wandb(report: dict, cfg: LoggerConfig, out_dir: Path) -> None:
    """The report's figures, its acceptance curve and report.json in a W&B run (offline unless configured)."""
    if cfg.kind == "none":
        return
    import wandb

    run = wandb.init(project=cfg.project, name=cfg.name or out_dir.name, dir=str(out_dir), mode=wandb_mode(cfg),
                     config=report["config"], job_type="acceptance-report")
    run.summary.update({key: report[key] for key in ("acceptance_length", "tokens_per_second",
                                                     "baseline_tokens_per_second", "speedup", "outputs_match_baseline")})
    curve = wandb.Table(data=list(enumerate(report["acceptance_rate_per_position"], 1)),
                        columns=["position", "acceptance_rate"])
    run.log({"acceptance_curve": wandb.plot.line(curve, "position", "acceptance_rate", title="acceptance per position")})
    run.save(str(out_dir / "report.json"), base_path=str(out_dir))
    run.finish()


def table(report: dict) -> str:
    lines = [f"{'position':>8} {'acceptance':>10}"]
    lines += [f"{i:>8} {rate:>10.3f}" for i, rate in enumerate(report["acceptance_rate_per_position"], 1)]
    lines += [
        f"acceptance length tau: {report['acceptance_length']:.3f} over {report['num_drafts']} drafts",
        f"tokens/s: {report['tokens_per_second']:.1f} speculative vs {report['baseline_tokens_per_second']:.1f} "
        f"target-only (speed-up {report['speedup']:.2f}x)",
        "decode time: " + ", ".join(f"{name} {secs:.2f}s" for name, secs in report["time_split_s"].items()),
        f"outputs match target-only greedy: {report['outputs_match_baseline']}" + (
            " (w8a8 rounds activations, which amplifies last-bit differences between a 1-token and a "
            "(k+1)-token forward: lossless in distribution, not always token for token)"
            if report["outputs_match_baseline"] is False and report["config"]["quant"]["scheme"] == "w8a8" else ""),
    ]
    return "\n".join(lines)
