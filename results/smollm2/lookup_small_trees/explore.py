"""Small trees and lookup against chains, one interleaved round: tokens/s and tau, the shipped drafter on
the fp32 target, greedy, both turns of 8 MT-bench conversations, 128 new tokens (explore.txt).
python results/smollm2/lookup_small_trees/explore.py '[["NAME", MODE, K, TOP_K, TOTAL, {DraftingConfig fields}], ...]'"""
import json
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from benchmarks import rounds
from benchmarks.bench import BenchConfig
from common.config import to_dataclass
from inference import evalsets, report
from inference.drafting import DraftingConfig
from inference.engine import Stats, generate

torch.set_num_threads(2)
with initialize_config_dir(str(Path(__file__).resolve().parents[3] / "conf" / "benchmarks"), version_base="1.3"):
    cfg = compose("bench", [f"drafter={Path(__file__).resolve().parents[3] / 'models' / 'smollm2-eagle3'}", "eval=mtbench", "eval.num_prompts=8",
                            "max_new_tokens=128", "assistant=null"])
cfg = to_dataclass(BenchConfig, cfg)
drafter, target = report.load_pair(cfg.drafter, cfg.target)
drafter.eval()
prompts = [p.ids for p in evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)]
shapes = json.loads(sys.argv[1])  # [[name, mode, k, top_k, total], ...]
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
stats = {}
def way(name, mode, k, top_k, total, extra=None):
    how = DraftingConfig(mode, top_k, total, **(extra or {}))
    def run(ids):
        g = generate(target, drafter if k else None, ids, cfg.max_new_tokens, k, drafting=how)
        stats.setdefault(name, []).append(g.stats)
        return g.tokens
    return run
ways = {"target_only": way("target_only", "chain", 0, 1, 1)} | {s[0]: way(*s) for s in shapes}
timed = rounds.interleaved(ways, prompts, repeats)
base = timed["target_only"].median_tokens_per_s()
for name, t in timed.items():
    total = Stats(5)
    for s in stats[name]:
        total.add(s)
    tau = total.acceptance_length if name != "target_only" else 1.0
    print(f"{name:<24} {t.median_tokens_per_s():6.1f} tok/s {t.median_tokens_per_s()/base:5.2f}x tau {tau:.2f} "
          f"same {t.results == timed['target_only'].results}", flush=True)
