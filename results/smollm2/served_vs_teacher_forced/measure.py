"""Served first drafts against the drafter's teacher-forced predictions on the same greedy outputs.

    python results/smollm2/served_vs_teacher_forced/measure.py DRAFTER EVAL NUM_PROMPTS > OUT.json

Decodes NUM_PROMPTS first turns of EVAL (128 new tokens, K=5 chains, the engine of inference/engine.py)
and records, at every verification step, the first draft the engine served. Then one target pass over
prompt + output gives the drafter's step-0 prediction at every position, as training's validation
computes it (speculators/eagle3.py training_loss, step 0). Served == teacher-forced at every step says
serving feeds the drafter what training did; the gap between per-step acceptance of the first draft
and per-token accuracy over the whole output is then selection: steps start where a chain failed.
"""
import json
import sys

import torch

from inference import evalsets, report
from inference.drafting import ChainProposer
from inference.engine import generate
from inference.evalsets import EvalConfig

torch.set_num_threads(1)
drafter_path, eval_name, num_prompts = sys.argv[1], sys.argv[2], int(sys.argv[3])
drafter, target = report.load_pair(drafter_path)
prompts = evalsets.prompts(EvalConfig(name=eval_name, num_prompts=num_prompts, turns=1), target, 128)
served = []  # (verified positions, first draft) per step
propose = ChainProposer.propose


def recording_propose(self, temperature, generator):
    draft = propose(self, temperature, generator)
    served.append((self.cache.length, draft.tokens[0]))
    return draft


ChainProposer.propose = recording_propose
counts = dict(steps=0, served_accepted=0, teacher_forced_right_at_steps=0, steps_served_equals_teacher_forced=0,
              tokens=0, teacher_forced_right=0)
for prompt in prompts:
    served.clear()
    seq = prompt.ids + generate(target, drafter, prompt.ids, 128, k=5).tokens
    with torch.no_grad():
        features = drafter.features(target(torch.tensor([seq])))
        logits, _ = drafter.step(drafter.new_cache(1, len(seq)), torch.tensor([seq[1:]]), features[:, :-1])
    predicted = drafter.draft_to_target[logits[0].argmax(-1)].tolist()  # predicted[t] is the guess for seq[t + 2]
    for verified, first in served:
        t = verified - 1
        if t + 2 < len(seq):
            counts["steps"] += 1
            counts["served_accepted"] += first == seq[t + 2]
            counts["teacher_forced_right_at_steps"] += predicted[t] == seq[t + 2]
            counts["steps_served_equals_teacher_forced"] += first == predicted[t]
    for t in range(len(prompt.ids) - 1, len(seq) - 2):
        counts["tokens"] += 1
        counts["teacher_forced_right"] += predicted[t] == seq[t + 2]
rates = {"served_first_draft_acceptance": counts["served_accepted"] / counts["steps"],
         "teacher_forced_accuracy_at_steps": counts["teacher_forced_right_at_steps"] / counts["steps"],
         "served_equals_teacher_forced": counts["steps_served_equals_teacher_forced"] / counts["steps"],
         "teacher_forced_accuracy_over_all_tokens": counts["teacher_forced_right"] / counts["tokens"]}
print(json.dumps({"drafter": drafter_path, "eval": eval_name, "num_prompts": num_prompts, "max_new_tokens": 128,
                  "k": 5, "target": target.name_or_path} | counts | rates, indent=1))
