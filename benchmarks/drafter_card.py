"""Measure a drafter for a chat target and write its model card (models/smollm2-eagle3).

    python -m benchmarks.drafter_card drafter=<export> out=models/smollm2-eagle3

Every figure comes from this run. Acceptance comes from the one evaluation loop (inference/report.py
`measure`: tau, acceptance per position, outputs against target-only decoding), speed from the
interleaved benchmark (benchmarks/bench.py `run`). Served on the target the drafter was trained
against (training.json's quant, e.g. gguf: the file's own 4-bit blocks):
- acceptance: MT-bench first and second turns in chains of K, alone and behind n-gram lookup
  (inference.lookup.LookupProposer), first turns in trees, ShareGPT's test split, and MT-bench first
  turns at temperature 1 (lossless sampling);
- speed on MT-bench first turns, on the fp32 target and on the served (packed) one: target-only
  decoding in our engine, speculative chains (fixed, and ending where the drafter is unsure) and trees,
  chains behind n-gram lookup, transformers'
  generate and prompt lookup;
  with the time split of a chain and the bound tau / (1 + K c) its measured costs set;
- llama.cpp on the same GGUF (a target served from one): its plain decoding, n-gram speculation and this
  drafter exported as GGUF, beside our engine (benchmarks/llamacpp_bench.py);
- `check`: what tests/test_shipped_drafter.py measures again (a few prompts, short answers).
Writes <out>/card.json and <out>/README.md, a card with the training facts of training.json and, when
the drafter folder has one, its hand-written RECIPE.md (the data, the schedule and why) verbatim.
"""

import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
from omegaconf import DictConfig

from benchmarks import bench, llamacpp_bench
from benchmarks.compare import vocabulary_coverage
from benchmarks.tables import write_result
from common.config import PROJECT_ROOT, at_least, exit_on_user_error, require, run_cli, to_dataclass
from inference import evalsets, report
from inference.drafting import DraftingConfig, serving_k
from inference.evalsets import EvalConfig
from speculators import export
from speculators.quant import QuantConfig
from speculators.target import FrozenTarget, TargetConfig

KEPT = ("acceptance_length", "acceptance_rate_per_position", "num_prompts", "num_drafts", "num_draft_tokens",
        "num_accepted_tokens", "lookup_drafts", "lookup_accepted_tokens", "outputs_match_baseline",
        "tokens_per_second", "baseline_tokens_per_second", "speedup", "time_split_s")


@dataclass
class DrafterCardConfig:
    """conf/benchmarks/drafter_card.yaml."""

    drafter: str = "???"  # an export folder that names its target and has training.json
    out: str = "???"
    num_prompts: int = 8  # conversations per eval set
    max_new_tokens: int = 128
    speed_prompts: int = 4  # MT-bench first turns in the speed benchmark
    repeats: int = 3
    chain_lengths: list[int] = field(default_factory=lambda: [1, 2, 3])  # shorter chains timed beside K
    lookup_chain_lengths: list[int] = field(default_factory=lambda: [1, 2])  # K of chains behind n-gram lookup timed
    chain_min_probs: list[float] = field(default_factory=lambda: [0.4])  # chains of K ending where the drafter is unsure
    check_prompts: int = 3  # what the shipped-drafter test serves again
    check_new_tokens: int = 48

    def __post_init__(self):
        for key in ("chain_lengths", "lookup_chain_lengths"):
            require(all(k >= 1 for k in getattr(self, key)), key, getattr(self, key), "chain lengths >= 1")
        at_least(1, num_prompts=self.num_prompts, max_new_tokens=self.max_new_tokens, speed_prompts=self.speed_prompts,
                 repeats=self.repeats, check_prompts=self.check_prompts, check_new_tokens=self.check_new_tokens)


def acceptance_sets(cfg: DrafterCardConfig) -> dict[str, tuple[EvalConfig, DraftingConfig, float]]:
    """name -> (eval set, drafting, temperature)."""
    mtbench = EvalConfig("mtbench", num_prompts=cfg.num_prompts, turns=1)
    chain = DraftingConfig("chain")
    return {"mtbench_chain": (replace(mtbench, turns=2), chain, 0.0),
            "mtbench_chain_lookup": (replace(mtbench, turns=2), lookup(cfg), 0.0),
            "mtbench_turn1_tree": (mtbench, DraftingConfig("tree"), 0.0),
            "sharegpt_chain": (EvalConfig("sharegpt", num_prompts=cfg.num_prompts), chain, 0.0),
            "mtbench_turn1_temperature1": (mtbench, chain, 1.0)}


def lookup(cfg: DrafterCardConfig) -> DraftingConfig:
    """Chains behind n-gram lookup, as the speed benchmark drafts them."""
    return bench.BenchConfig(drafter=cfg.drafter).lookup()


def serve(target, drafter, served: QuantConfig, eval_cfg: EvalConfig, drafting: DraftingConfig, temperature: float,
          max_new_tokens: int, drafter_path: str) -> dict:
    """The acceptance report's figures (and per-turn tau) on one eval set."""
    cfg = report.InferenceConfig(drafter=drafter_path, quant=served, eval=eval_cfg, max_new_tokens=max_new_tokens,
                                 temperature=temperature, drafting=drafting)
    result = report.measure(target, drafter, evalsets.prompts(eval_cfg, target, max_new_tokens), cfg)
    figures = {key: result[key] for key in KEPT} | {
        "draft_vocabulary_coverage": vocabulary_coverage(drafter, [r["baseline_output_ids"] for r in result["prompts"]])}
    for turn, f in (result["per_turn"] or {}).items():
        rows = [row for row in result["prompts"] if str(row["turn"]) == turn]
        same = all(row["matches_baseline"] for row in rows) if temperature == 0 else None
        figures.setdefault("per_turn", {})[turn] = {key: f[key] for key in KEPT if key in f} | {
            "outputs_match_baseline": same}
    return figures


def speed(target, drafter, cfg: DrafterCardConfig) -> dict:
    """bench.run on MT-bench first turns: tokens/s and speed-up over our own target-only decoding, for
    chains of the drafter's K, trees, the shorter chains cfg.chain_lengths, chains of K that stop where the
    drafter is unsure (cfg.chain_min_probs) and chains behind n-gram lookup."""
    eval_cfg = EvalConfig("mtbench", num_prompts=cfg.speed_prompts, turns=1)
    prompts = [p.ids for p in evalsets.prompts(eval_cfg, target, cfg.max_new_tokens)]
    shorter = [k for k in cfg.chain_lengths if k != drafter.depth]
    bench_cfg = bench.BenchConfig(drafter=cfg.drafter, eval=eval_cfg, max_new_tokens=cfg.max_new_tokens,
                                  repeats=cfg.repeats, chain_lengths=shorter,
                                  lookup_chain_lengths=cfg.lookup_chain_lengths, chain_min_probs=cfg.chain_min_probs)
    return bench.run(target, drafter, None, prompts, bench_cfg)


def llamacpp_comparison(target, drafter, cfg: DrafterCardConfig) -> dict | None:
    """benchmarks/llamacpp_bench.py on the speed benchmark's prompts; None for a target not served from a GGUF file."""
    if not target.name_or_path.endswith(".gguf"):
        return None
    bench_cfg = llamacpp_bench.LlamacppBenchConfig(
        drafter=cfg.drafter, eval=EvalConfig("mtbench", num_prompts=cfg.speed_prompts, turns=1),
        max_new_tokens=cfg.max_new_tokens, repeats=cfg.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        return llamacpp_bench.measure(cfg.drafter, drafter, target, bench_cfg, Path(tmp))


def bound(chain: dict, k: int) -> dict:
    """Where a chain's time goes and the speed-up its measured costs allow: tau / (1 + K c) with c the
    cost of a draft step over a target-only token, and verification priced at a target-only token."""
    split, drafts = chain["time_split_s"], max(chain["num_drafts"], 1)
    per_token = 1 / chain["baseline_tokens_per_second"]
    c = split["draft"] / drafts / k / per_token
    return {"draft_ms_per_cycle": 1000 * split["draft"] / drafts, "verify_ms_per_cycle": 1000 * split["verify"] / drafts,
            "other_ms_per_cycle": 1000 * split["other"] / drafts, "target_only_ms_per_token": 1000 * per_token,
            "c": c, "bound": chain["acceptance_length"] / (1 + k * c)}


def measure(cfg: DrafterCardConfig) -> dict:
    record = export.training_record(Path(cfg.drafter)) or {}
    served = QuantConfig(**record.get("quant", {}))
    drafter, packed = report.load_pair(cfg.drafter, quant=served, drafter_quant="none")  # as trained, as engines get it
    k = serving_k(drafter, None)
    card = {"drafter": cfg.drafter, "target": packed.name_or_path, "served_quant": asdict(served), "k": k,
            "training": record, "config": asdict(cfg), "lookup": asdict(lookup(cfg)), "acceptance": {}}
    sets = acceptance_sets(cfg)
    for i, (name, (eval_cfg, drafting, temperature)) in enumerate(sets.items(), 1):
        figures = serve(packed, drafter, served, eval_cfg, drafting, temperature, cfg.max_new_tokens, cfg.drafter)
        card["acceptance"][name] = figures
        print(f"acceptance {i}/{len(sets)} {name}: tau {figures['acceptance_length']:.2f}", flush=True)  # a set takes minutes
    card["chain_costs"] = bound(card["acceptance"]["mtbench_chain"]["per_turn"]["1"], k)
    check_cfg = EvalConfig("mtbench", num_prompts=cfg.check_prompts, turns=1)
    card["check"] = serve(packed, drafter, served, check_cfg, DraftingConfig("chain"), 0.0, cfg.check_new_tokens,
                          cfg.drafter)
    card["speed"] = {"packed": speed(packed, drafter, cfg)}
    card["llamacpp"] = llamacpp_comparison(packed, drafter, cfg)
    fp32 = FrozenTarget.load(TargetConfig.named(packed.name_or_path, layer_ids=drafter.layer_ids))
    card["speed"]["fp32"] = speed(fp32, drafter, cfg)
    card |= {"git_revision": report.git_revision(), "machine": report.machine()}
    return card


def lookup_settings(card: dict) -> str:
    lookup_cfg = card["lookup"]
    return (f"n-grams of {lookup_cfg['prompt_lookup_max']} down to {lookup_cfg['prompt_lookup_min']} tokens, "
            f"lookup chains of up to {lookup_cfg['prompt_lookup_tokens']}")


def markdown(card: dict) -> str:
    """The card's README: what it is and how to use it, the measured tables, then how it was trained."""
    t, k = card["training"], card["k"]
    acc = card["acceptance"]
    lines = [f"# {Path(card['drafter']).name}: an EAGLE-3 drafter for {card['target']}", "",
             f"Trained here for {t.get('steps')} steps ({t.get('tokens_seen', 0):,} tokens seen) against the target "
             f"served as quant={card['served_quant']['scheme']}; K={k} draft tokens. Every figure below is measured "
             f"by `python -m benchmarks.drafter_card` (card.json holds them all, with the machine and revision).", "",
             *usage(card),
             "## Acceptance (greedy unless said; outputs compared with target-only decoding)", "",
             "| eval set | drafting | tau | acceptance per position | same output | target tokens in the draft vocabulary |",
             "|---|---|---|---|---|---|"]
    lookup_chain = "chain behind n-gram lookup"
    rows = [("MT-bench turn 1", "chain", acc["mtbench_chain"]["per_turn"]["1"]),
            ("MT-bench turn 2", "chain", acc["mtbench_chain"]["per_turn"]["2"]),
            ("MT-bench turn 1", lookup_chain, acc["mtbench_chain_lookup"]["per_turn"]["1"]),
            ("MT-bench turn 2", lookup_chain, acc["mtbench_chain_lookup"]["per_turn"]["2"]),
            ("MT-bench turn 1", "tree", acc["mtbench_turn1_tree"]),
            ("ShareGPT test", "chain", acc["sharegpt_chain"]),
            ("MT-bench turn 1, temperature 1", "chain", acc["mtbench_turn1_temperature1"])]
    for name, mode, f in rows:
        curve = ", ".join(f"{a:.2f}" for a in f["acceptance_rate_per_position"])
        same = "n/a (sampled)" if f["outputs_match_baseline"] is None else str(f["outputs_match_baseline"])
        coverage = f"{f['draft_vocabulary_coverage']:.1%}" if "draft_vocabulary_coverage" in f else "-"
        lines.append(f"| {name} ({f['num_prompts']} prompts) | {mode} | {f['acceptance_length']:.2f} | {curve} | {same} "
                     f"| {coverage} |")
    lines += ["", f"Behind n-gram lookup (K={k}; {lookup_settings(card)}), both turns:"
              f" {report.lookup_line(acc['mtbench_chain_lookup']).strip()}."]
    lines += ["", "## Speed (MT-bench first turns, greedy, batch 1, interleaved, median of repeats)", "",
              "| target | method | tokens/s | speed-up | same output |", "|---|---|---|---|---|"]
    for target, rows_ in card["speed"].items():
        for method, r in rows_.items():
            lines.append(f"| {target} | {method} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['outputs_match_target_only']} |")
    if card["llamacpp"]:
        lines += ["", "## llama.cpp on the same GGUF (benchmarks/llamacpp_bench.py; 1 thread, the speed prompts)", "",
                  "```", llamacpp_bench.table(card["llamacpp"]), "```"]
    b = card["chain_costs"]
    lines += ["", f"A chain cycle on the served target: drafting {b['draft_ms_per_cycle']:.1f} ms, verification "
              f"{b['verify_ms_per_cycle']:.1f} ms, other {b['other_ms_per_cycle']:.1f} ms, against "
              f"{b['target_only_ms_per_token']:.1f} ms a target-only token: c = {b['c']:.3f}, and tau / (1 + K c) = "
              f"{b['bound']:.2f} is the speed-up the draft cost allows if verification cost no more than a token."]
    if card["recipe"]:
        lines += ["", card["recipe"].strip()]
    return "\n".join(lines) + "\n"


def usage(card: dict) -> list[str]:
    """How to serve it: the bundled engine on the target it was trained for, in the chain setting that served it
    fastest, and the other engines' formats."""
    drafter, quant = card["drafter"], card["served_quant"]["scheme"]
    overrides, setting, speedup = fastest_setting(card["speed"]["packed"], card["lookup"])
    return ["## Use it", "",
            f"    python -m inference drafter={drafter} quant={quant} eval=mtbench {overrides}",
            f"    python -m speculators.export source={drafter} out=OUT format=eagle3 dtype=bfloat16  # SGLang, EAGLE-3",
            f"    python -m speculators.export source={drafter} out=draft.gguf format=gguf  # llama.cpp: -md draft.gguf "
            "--spec-type draft-eagle3",
            "",
            "The folder itself is in the vLLM speculators format (`config.json`, `model.safetensors`; the embeddings "
            "are the target's own, left out). The bundled engine serves it with the target named in its config; "
            f"of the chains in the speed table below, {setting} served that target fastest ({speedup:.2f}x).", ""]


def fastest_setting(rows: dict, lookup: dict) -> tuple[str, str, float]:
    """(the inference command's overrides, what they set, speed-up) of the chain method of bench.run that decoded
    fastest: plain (`speculative_chain`, `speculative_chain_k<N>`), stopping where the drafter is unsure
    (`speculative_chain_min_prob<p>`) or behind n-gram lookup (`speculative_chain_k<N>_lookup`, with the n-gram
    settings of `lookup`, the card's lookup DraftingConfig)."""
    best = max((m for m in rows if m.startswith("speculative_chain")), key=lambda m: rows[m]["speedup"])
    k = rows[best]["k"]
    overrides, setting = f"k={k}", f"K={k}"
    if best.endswith("_lookup"):
        overrides += "".join(f" drafting.{key}={lookup[key]}"
                             for key in ("prompt_lookup_max", "prompt_lookup_min", "prompt_lookup_tokens"))
        setting += " behind n-gram lookup"
    elif "_min_prob" in best:
        p = best.rsplit("_min_prob", 1)[1]
        overrides += f" drafting.chain_min_prob={p}"
        setting += f", stopping before a draft below probability {p}"
    return overrides, setting, rows[best]["speedup"]


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="drafter_card", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    cfg = to_dataclass(DrafterCardConfig, cfg)
    card = measure(cfg)
    recipe = Path(cfg.drafter) / "RECIPE.md"  # read after measuring: an edit made meanwhile is the one written
    card["recipe"] = recipe.read_text() if recipe.is_file() else None
    write_result(Path(cfg.out), card, markdown(card), "card.json", "README.md")


if __name__ == "__main__":
    run_cli(main)
