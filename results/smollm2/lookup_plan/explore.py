"""N-gram lookup in front of the shipped EAGLE-3 drafter, fixed and planned, against K=1 and 2 alone: one report
loop (inference/report.py measure_arms), interleaved with target-only decoding prompt by prompt, packed 4-bit target,
128 new tokens, medians over repeats.

    python results/smollm2/lookup_plan/explore.py mtbench 8 2    # eval set, conversations, repeats

before_fix_33c1a39.json: every arm but k1_look5_plan on 33c1a39; after_fix.json: k2, the lookup arms and both
planned ones on fec9264 (lookup planned from its own counts at no drafter cost).
"""

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from inference import evalsets, report  # noqa: E402
from inference.drafting import DraftingConfig  # noqa: E402
from speculators.quant import QuantConfig  # noqa: E402


def lookup(tokens: int, plan: bool = False) -> DraftingConfig:
    return DraftingConfig(prompt_lookup_max=3, prompt_lookup_min=2, prompt_lookup_tokens=tokens, plan=plan)


def main(name: str, conversations: int, repeats: int) -> None:
    cfg = report.InferenceConfig(drafter=str(REPO / "models/smollm2-eagle3"), max_new_tokens=128,
                                 quant=QuantConfig(scheme="gguf"),
                                 eval=evalsets.EvalConfig(name=name, num_prompts=conversations,
                                                          turns=2 if name == "mtbench" else 1))
    drafter, target = report.load_pair(cfg.drafter, None, cfg.quant)
    prompts = evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)
    arms = {"k1": (drafter, 1), "k2": (drafter, 2), "k1_look5": (drafter, 1, lookup(5)),
            "k2_look5": (drafter, 2, lookup(5)), "k1_look3": (drafter, 1, lookup(3)),
            "k1_look5_plan": (drafter, 1, lookup(5, plan=True)), "k2_look5_plan": (drafter, 2, lookup(5, plan=True))}
    runs = [report.measure_arms(target, arms, prompts, cfg) for _ in range(repeats)]
    out = {}
    for arm in arms:
        first = runs[0][arm]
        out[arm] = {"speedup": statistics.median(run[arm]["speedup"] for run in runs),
                    "reps": [run[arm]["speedup"] for run in runs], "tau": first["acceptance_length"],
                    "same": all(run[arm]["outputs_match_baseline"] for run in runs),
                    "per_turn": {turn: v["speedup"] for turn, v in (first["per_turn"] or {}).items()},
                    "lookup_drafts": first["lookup_drafts"], "num_drafts": first["num_drafts"],
                    "base": statistics.median(run[arm]["baseline_tokens_per_second"] for run in runs)}
        print(arm, json.dumps(out[arm]), flush=True)
    Path(f"lookup_{name}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
