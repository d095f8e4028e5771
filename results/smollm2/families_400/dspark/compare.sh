#!/bin/bash
# tau of the drafters of run.sh on the same prompts, each at the K its export records (DSpark 8, the block; DFlash
# and EAGLE-3 2, the K their closing reports served), served by our engine on the packed target they were
# trained against, greedy, with each drafter's difference from DSpark prompt by prompt: both turns of 16 MT-bench
# conversations, and 6 ShareGPT test conversations (not run on 2026-12-05: no time left). Speeds in these tables ran beside other jobs: planning.sh measures speed.
#   bash results/smollm2/families_400/dspark/compare.sh RUNS
set -e
RUNS=${1:?usage: compare.sh RUNS_DIR}
OUT=results/smollm2/families_400/dspark
DRAFTERS="drafters=[$RUNS/dspark/export,$RUNS/dflash8/export,$RUNS/eagle3/export,$RUNS/dspark_a128/export]"
python -m benchmarks.compare "$DRAFTERS" quant=gguf eval=mtbench eval.turns=2 eval.num_prompts=16 max_new_tokens=96 repeats=1 out=$OUT/mtbench
python -m benchmarks.compare "$DRAFTERS" quant=gguf eval=sharegpt eval.num_prompts=6 max_new_tokens=96  repeats=1 out=$OUT/sharegpt
