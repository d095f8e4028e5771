"""Compare drafters: several exports, one target, the same prompts; one table, one plot.

    python -m benchmarks.compare drafters=[runs/a/export,runs/b/export,...] [quant=gguf] [modes=[chain,tree]] [eval=...] [out=DIR]

Trains nothing. Every drafter (and each drafting mode it has, among `modes`) decodes the
same prompts (eval=, inference/evalsets.py) greedily with K = k, or each
drafter's own K (the depth it was trained for) when that is null, interleaved with target-only
decoding prompt by prompt, for `repeats` rounds; tokens/s is the median over rounds. Per row:
tau and the acceptance rate per position (vLLM's definitions), tokens/s, speed-up, where the
time goes, whether outputs equal target-only greedy, and the drafter's training budget from
its training.json (steps, tokens seen, wall time). Two figures say how far a difference in tau is real:
its standard error over prompts with, for every drafter after the first, its difference from the first drafter
prompt by prompt (mean ± standard error: the prompts and target outputs are the same), and the drafter's
vocabulary coverage (the share of target-only output
tokens its draft vocabulary holds: no position's acceptance rate can exceed it). Writes <out>/compare.json, compare.md, compare.png.
"""

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks import rounds
from benchmarks.tables import paired, spread, write_result
from common import plots
from common.config import PROJECT_ROOT, UserError, at_least, exit_on_user_error, require, run_cli, to_dataclass
from inference import evalsets
from inference.drafting import DraftingConfig, serving_k
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig


@dataclass
class CompareConfig:
    drafters: list[str] = field(default_factory=list)  # export folders, all for the same target
    target: str | None = None  # None: the verifier the first drafter's config names
    quant: QuantConfig = field(default_factory=QuantConfig)  # the target as served: quant=gguf, its file's own 4-bit blocks
    modes: list[str] = field(default_factory=lambda: ["chain"])  # drafting modes; each drafter runs those it has
    eval: EvalConfig = field(default_factory=EvalConfig)  # the prompts: eval=stdlib | mtbench | sharegpt | file
    max_new_tokens: int = 64
    k: int | None = None  # K for every drafter; None: each drafter's own
    tree_top_k: int = 4  # as in inference.drafting.DraftingConfig
    tree_total_tokens: int = 16
    repeats: int = 3
    out: str | None = None  # None: the Hydra run directory

    def __post_init__(self):
        if not self.drafters:
            raise UserError("drafters=[...]: give at least one export folder")
        for mode in self.modes:
            DraftingConfig(mode, self.tree_top_k, self.tree_total_tokens)  # validates each
        require(self.k is None or self.k >= 1, "k",
                self.k, ">= 1, or null for each drafter's own")
        at_least(1, max_new_tokens=self.max_new_tokens, repeats=self.repeats)


@dataclass
class Method:
    name: str
    drafter: object | None
    drafting: DraftingConfig
    training: dict | None = None
    k: int = 0  # draft tokens per step (0: target-only)
    seconds: list[float] = field(default_factory=list)  # per round
    tokens: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # first round
    stats: object = None  # engine.Stats summed over the first round's prompts
    tau_per_prompt: list[float] = field(default_factory=list)  # first round


def methods(drafters: list[tuple[str, object, dict | None]], cfg: CompareConfig) -> list[Method]:
    """Target-only first (the speed-up baseline), then every drafter in every mode it has."""
    from inference.drafting import modes

    rows = [Method("target_only", None, DraftingConfig())]
    names = [(training or {}).get("family") or Path(path).parent.name or Path(path).name
             for path, _, training in drafters]
    for (path, drafter, training), name in zip(drafters, names):
        label = name if names.count(name) == 1 else f"{name} {path}"  # two of a family: say which is which
        k = serving_k(drafter, cfg.k)
        for mode in cfg.modes:
            if mode in modes(drafter):
                rows.append(Method(f"{label} ({mode})", drafter, DraftingConfig(mode, cfg.tree_top_k,
                                                                                cfg.tree_total_tokens), training, k))
    return rows


def run(target, rows: list[Method], prompts: list[list[int]], cfg: CompareConfig) -> None:
    from inference.engine import Stats, check_pair, generate

    for row in rows[1:]:
        check_pair(target, row.drafter)

    def decode(row: Method):
        return lambda ids: generate(target, row.drafter, ids, cfg.max_new_tokens, row.k, drafting=row.drafting)

    timed = rounds.interleaved({i: decode(row) for i, row in enumerate(rows)}, prompts, cfg.repeats,
                               count=lambda out, wall: (len(out.tokens), wall))
    for i, row in enumerate(rows):
        row.seconds, row.tokens = timed[i].seconds, timed[i].tokens
        row.outputs = [out.tokens for out in timed[i].results]
        row.stats = Stats(row.k)
        for out in timed[i].results:
            row.stats.add(out.stats)
        row.tau_per_prompt = [out.stats.acceptance_length for out in timed[i].results]


def tau_standard_error(accepted_at: list[int], drafts: int) -> float:
    """Standard error of tau = 1 + mean accepted per draft. A draft's accepted tokens are a
    prefix, so accepted_at[i-1] / drafts = P(a >= i), and E[a^2] = sum_i (2i - 1) P(a >= i).
    Drafts of one prompt are not independent, so this understates the error somewhat."""
    if drafts < 2:
        return float("nan")
    at_least_i = [a / drafts for a in accepted_at]
    mean = sum(at_least_i)
    square = sum((2 * i + 1) * p for i, p in enumerate(at_least_i))
    return ((square - mean**2) / (drafts - 1)) ** 0.5


def vocabulary_coverage(drafter, outputs: list[list[int]]) -> float:
    """Share of the target-only output tokens that are in the drafter's vocabulary."""
    kept = set(drafter.draft_to_target.tolist())
    tokens = [t for out in outputs for t in out]
    return sum(t in kept for t in tokens) / max(len(tokens), 1)


def summary(rows: list[Method]) -> list[dict]:
    base = statistics.median(t / s for t, s in zip(rows[0].tokens, rows[0].seconds))
    first = next((row for row in rows if row.drafter is not None), None)
    table = []
    for row in rows:
        served = row.drafter is not None
        speed = statistics.median(t / s for t, s in zip(row.tokens, row.seconds))
        table.append({
            "method": row.name,
            "drafting": row.drafting.mode if row.drafter is not None else None,
            "k": row.k if row.drafter is not None else None,
            "acceptance_length": row.stats.acceptance_length if row.drafter is not None else None,
            "acceptance_length_stderr": tau_standard_error(row.stats.accepted_at, row.stats.num_drafts)
            if row.drafter is not None else None,
            "acceptance_rate_per_position": row.stats.acceptance_rates,
            "draft_vocabulary_coverage": vocabulary_coverage(row.drafter, rows[0].outputs)
            if row.drafter is not None else None,
            "num_drafts": row.stats.num_drafts,
            "num_draft_tokens": row.stats.num_draft_tokens,
            "num_accepted_tokens": row.stats.num_accepted_tokens,
            "tokens_per_second": speed,
            "speedup": speed / base,
            "time_split_s": {"draft": row.stats.draft_s, "verify": row.stats.verify_s,
                             "other": row.stats.decode_s - row.stats.draft_s - row.stats.verify_s},
            "outputs_match_target_only": row.outputs == rows[0].outputs,
            "tau_over_prompts": spread(row.tau_per_prompt) if served else None,
            "tau_minus_first": paired(row.tau_per_prompt, first.tau_per_prompt) if served and row is not first else None,
            "tau_per_prompt": row.tau_per_prompt if served else None,
            "training": row.training,
        })
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| drafter | tau (± s.e. over prompts) | minus the first drafter, per prompt | acceptance per position "
             "| vocab coverage | tokens/s | speed-up | matches | steps | tokens seen | training time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        tau = "-" if r["acceptance_length"] is None else \
            f"{r['acceptance_length']:.2f} ± {r['tau_over_prompts']['se']:.2f}"
        minus = "-" if not r["tau_minus_first"] else \
            f"{r['tau_minus_first']['mean']:+.3f} ± {r['tau_minus_first']['se']:.3f}"
        coverage = "-" if r["draft_vocabulary_coverage"] is None else f"{r['draft_vocabulary_coverage']:.3f}"
        curve = " ".join(f"{a:.2f}" for a in r["acceptance_rate_per_position"]) or "-"
        training = r["training"] or {}
        minutes = "-" if training.get("wall_time_s") is None else f"{training['wall_time_s'] / 60:.0f} min"
        lines.append(f"| {r['method']} | {tau} | {minus} | {curve} | {coverage} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['outputs_match_target_only'] else 'NO'} | {training.get('steps', '-')} | "
                     f"{training.get('tokens_seen', '-')} | {minutes} |")
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    with plots.figure(path, (6, 4)) as ax:
        for r in table[1:]:
            rates = r["acceptance_rate_per_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o",
                    label=f"{r['method']}: tau {r['acceptance_length']:.2f}, {r['speedup']:.2f}x")
        positions = range(1, max(len(r["acceptance_rate_per_position"]) for r in table) + 1)
        ax.set(xlabel="draft position i", ylabel="acceptance rate", ylim=(0, 1), xticks=positions,
               title="acceptance per position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def write(result: dict, out_dir: Path) -> Path:
    return write_result(out_dir, result, markdown(result["rows"]), "compare.json", "compare.md",
                        lambda path: plot(result["rows"], path))


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="compare", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    from inference import report
    from speculators import export

    cfg = to_dataclass(CompareConfig, cfg)
    loaded, target = report.load_drafters(cfg.drafters, cfg.target, cfg.quant)
    drafters = [(path, drafter, export.training_record(path)) for path, drafter in zip(cfg.drafters, loaded)]
    prompts = [p.ids for p in evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)]
    rows = methods(drafters, cfg)
    run(target, rows, prompts, cfg)
    result = {"rows": summary(rows), "target": target.name_or_path, "config": asdict(cfg),
              "git_revision": report.git_revision(), "machine": report.machine()}
    write(result, Path(cfg.out or HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    run_cli(main)
