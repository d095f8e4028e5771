#!/bin/bash
# Speed: every drafter of run.sh and the shipped EAGLE-3 at fixed K and with cost-aware verification
# (drafting.plan), interleaved with target-only decoding prompt by prompt, median of 2 rounds, nothing beside:
# the packed 4-bit target they were trained against, then the fp32 target (the three trained here, K=1 and 2).
# 4 MT-bench first turns fit the calibration, the next 8 (packed) or 4 (fp32) are timed.
#   bash results/smollm2/families_400/dspark/planning.sh RUNS
set -e
RUNS=${1:?usage: planning.sh RUNS_DIR}
OUT=results/smollm2/families_400/dspark
DRAFTERS="drafters=[$RUNS/dspark/export,$RUNS/dflash8/export,$RUNS/eagle3/export,models/smollm2-eagle3]"
TRAINED="drafters=[$RUNS/dspark/export,$RUNS/dflash8/export,$RUNS/eagle3/export]"
python -m benchmarks.planning "$TRAINED" quant=none eval=mtbench eval.turns=1 eval.num_prompts=8 calibration_prompts=4 "ks=[1,2]" max_new_tokens=64 repeats=2 out=$OUT/planning_fp32
python -m benchmarks.planning "$DRAFTERS" quant=gguf eval=mtbench eval.turns=1 eval.num_prompts=12 calibration_prompts=4 "ks=[1,2,4]" max_new_tokens=64 repeats=2 out=$OUT/planning_packed
# The same on the packed target after d55ead0, where a CPU serves the drafters' linear layers in int8 (drafter_quant)
python -m benchmarks.planning "$DRAFTERS" quant=gguf eval=mtbench eval.turns=1 eval.num_prompts=12 calibration_prompts=4 "ks=[1,2,4]" max_new_tokens=64 repeats=2 out=$OUT/planning_packed_int8
# Again after 6c1f37f (a bias per position beside each temperature in the calibration)
python -m benchmarks.planning "$DRAFTERS" quant=gguf eval=mtbench eval.turns=1 eval.num_prompts=12 calibration_prompts=4 "ks=[1,2,4]" max_new_tokens=64 repeats=2 out=$OUT/planning_packed_bias
# Behind n-gram lookup (57176c0: lookup planned from its own counts), both MT-bench turns (turn 2 repeats turn 1)
python -m benchmarks.planning "$DRAFTERS" quant=gguf eval=mtbench eval.turns=2 eval.num_prompts=8 calibration_prompts=4 "ks=[1,2]" lookup_tokens=5 max_new_tokens=64 repeats=2 out=$OUT/planning_packed_lookup
