"""Where the drafter's first draft misses, by how sure the target itself is of the token it decodes.

    python results/smollm2/confidence/measure.py DRAFTER NUM_PROMPTS > OUT.json

Decodes both turns of NUM_PROMPTS MT-bench conversations greedily (128 new tokens, the engine of
inference/engine.py; its output is the target's own greedy output), then one target pass over prompt +
output gives, at every output position, the target's probability of the token it chose (its top-1
probability) and the drafter's step-0 prediction of that token, as training's validation computes it
(speculators/eagle3.py training_loss, step 0). Bucketed by the target's top-1 probability: the share of
output tokens, the share outside the draft vocabulary (no draft can name them) and the drafter's accuracy
(top-1, and top-2 as a tree of two children would offer it).
"""
import json
import sys

import torch

from inference import evalsets, report
from inference.engine import generate
from inference.evalsets import EvalConfig

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)

torch.set_num_threads(2)
drafter_path, num_prompts = sys.argv[1], int(sys.argv[2])
drafter, target = report.load_pair(drafter_path)
prompts = evalsets.prompts(EvalConfig(name="mtbench", num_prompts=num_prompts, turns=2), target, 128)
drafted = set(drafter.draft_to_target.tolist())
buckets = [dict(low=lo, high=min(hi, 1.0), tokens=0, outside=0, top1=0, top2=0) for lo, hi in zip(EDGES, EDGES[1:])]
for prompt in prompts:
    seq = prompt.ids + generate(target, drafter, prompt.ids, 128, k=5).tokens
    with torch.no_grad():
        out = target(torch.tensor([seq]))
        logits, _ = drafter.step(drafter.new_cache(1, len(seq)), torch.tensor([seq[1:]]), drafter.features(out)[:, :-1])
    sure = out.logits[0].float().softmax(-1).max(-1).values  # sure[t]: the target's top-1 probability of seq[t + 1]
    guesses = drafter.draft_to_target[logits[0].topk(2, -1).indices]  # guesses[t]: the drafter's two for seq[t + 2]
    for t in range(len(prompt.ids) - 1, len(seq) - 2):
        bucket = next(b for b, hi in zip(buckets, EDGES[1:]) if sure[t + 1] < hi)
        bucket["tokens"] += 1
        bucket["outside"] += int(seq[t + 2] not in drafted)
        bucket["top1"] += int(guesses[t, 0] == seq[t + 2])
        bucket["top2"] += int(seq[t + 2] in guesses[t].tolist())
total = sum(b["tokens"] for b in buckets)
for b in buckets:
    b |= {"share": b["tokens"] / total, "outside_draft_vocabulary": b["outside"] / max(b["tokens"], 1),
          "top1_accuracy": b["top1"] / max(b["tokens"], 1),
          "top2_accuracy": b["top2"] / max(b["tokens"], 1)}
print(json.dumps({"drafter": drafter_path, "eval": "mtbench", "turns": 2, "num_prompts": num_prompts,
                  "max_new_tokens": 128, "target": target.name_or_path, "tokens": total,
                  "top1_accuracy": sum(b["top1"] for b in buckets) / total,
                  "top2_accuracy": sum(b["top2"] for b in buckets) / total, "buckets": buckets}, indent=1))
