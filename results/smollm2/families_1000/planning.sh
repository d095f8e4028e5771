#!/bin/bash
# Speed of run.sh's 1,000-step drafters with cost-aware verification against fixed K, as
# ../families_400/dspark/whole_answers/run.sh measured the 400-step ones: packed target, MT-bench first turns (4 fit
# the calibration, 8 are timed), 256 new tokens, median of 2 rounds interleaved with target-only decoding, nothing beside.
#   bash results/smollm2/families_1000/planning.sh RUNS
set -e
RUNS=${1:?usage: planning.sh RUNS_DIR}
rm -f ~/.cache/speculators-forge/step_costs/*.json  # the step costs measured afresh, with nothing beside
python -m benchmarks.planning "drafters=[$RUNS/dspark_1000/export,$RUNS/dflash_1000/export,$RUNS/eagle3_1000/export]" quant=gguf eval=mtbench eval.turns=1 eval.num_prompts=12 calibration_prompts=4 "ks=[1,2]" max_new_tokens=256 repeats=2 out=results/smollm2/families_1000/planning
