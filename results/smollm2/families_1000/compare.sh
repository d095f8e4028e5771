#!/bin/bash
# tau of run.sh's 1,000-step drafters over whole answers, as ../families_400/dspark/whole_answers/run.sh served the
# 400-step ones: K=5, both turns of 12 MT-bench conversations, 256 new tokens, packed target, greedy, nothing beside.
#   bash results/smollm2/families_1000/compare.sh RUNS
set -e
RUNS=${1:?usage: compare.sh RUNS_DIR}
OUT=results/smollm2/families_1000
python -m benchmarks.compare "drafters=[$RUNS/dspark_1000/export,$RUNS/dflash_1000/export,$RUNS/eagle3_1000/export]" quant=gguf eval=mtbench eval.turns=2 eval.num_prompts=12 max_new_tokens=256 k=5 repeats=1 out=$OUT/mtbench
