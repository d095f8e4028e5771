#!/bin/bash
# The 400-step drafters of ../run.sh over whole answers (256 new tokens, the length the training data's answers were
# regenerated to) where the earlier tables decoded 64-96: tau at K=5 for all three on both turns of 12 MT-bench
# conversations, then speed with cost-aware verification on MT-bench first turns (4 fit the calibration, 8 are
# timed, median of 2 interleaved rounds), packed target, nothing beside.
#   bash results/smollm2/families_400/dspark/whole_answers/run.sh RUNS
set -e
RUNS=${1:?usage: run.sh RUNS_DIR}
OUT=results/smollm2/families_400/dspark/whole_answers
python -m benchmarks.compare "drafters=[$RUNS/dspark/export,$RUNS/dflash8/export,$RUNS/eagle3/export]" quant=gguf eval=mtbench eval.turns=2 eval.num_prompts=12 max_new_tokens=256 k=5 repeats=1 out=$OUT/mtbench
rm -f ~/.cache/speculators-forge/step_costs/*.json  # the step costs measured afresh, with nothing beside
python -m benchmarks.planning "drafters=[$RUNS/dspark/export,$RUNS/dflash8/export,$RUNS/eagle3/export,models/smollm2-eagle3]" quant=gguf eval=mtbench eval.turns=1 eval.num_prompts=12 calibration_prompts=4 "ks=[1,2,4]" max_new_tokens=256 repeats=2 out=$OUT/planning
