#!/bin/bash
# Cost-aware verification for the families not in run.sh: EAGLE-1, P-EAGLE and Medusa-1 from scratch on the same
# rows, seed and 400 steps (../run.sh's recipes, closing report at one K), then each at fixed K and with
# drafting.plan on the packed target, as planning.sh's second command serves the others, nothing beside.
#   bash results/smollm2/families_400/dspark/plan_others.sh RUNS   (RUNS: run.sh's folder, its cache)
set -e
RUNS=${1:?usage: plan_others.sh RUNS_DIR}
. "$(dirname "$0")/../settings.sh"
REPORT="serve_eval.ks=[2] serve_eval.plan=false"
[ -d $CACHE ] || python -m train.hidden_cache conf=eagle3_smollm2 $ROWS trainer.num_threads=2
[ -f $RUNS/eagle1/export/config.json ] || python train.py conf=eagle $DATA $RUN $REPORT hydra.run.dir=$RUNS/eagle1
[ -f $RUNS/peagle/export/config.json ] || python train.py conf=peagle $DATA $RUN drafter.draft_vocab_size=8192 $REPORT hydra.run.dir=$RUNS/peagle
[ -f $RUNS/medusa/export/config.json ] || python train.py conf=medusa $DATA $RUN 'target.layer_ids=[2,15,27]' $REPORT hydra.run.dir=$RUNS/medusa
PLAN=(quant=gguf eval=mtbench eval.turns=1 eval.num_prompts=12 calibration_prompts=4 "ks=[1,2,4]" max_new_tokens=64 repeats=2)
python -m benchmarks.planning "drafters=[$RUNS/eagle1/export,$RUNS/peagle/export]" "${PLAN[@]}" out=results/smollm2/families_400/dspark/planning_packed_others
python -m benchmarks.planning "drafters=[$RUNS/medusa/export]" "${PLAN[@]}" out=results/smollm2/families_400/dspark/planning_packed_medusa
# Medusa again after a69a38b and d55ead0: only the heads a draft uses are computed (head by head with the plan), in int8
python -m benchmarks.planning "drafters=[$RUNS/medusa/export]" "${PLAN[@]}" out=results/smollm2/families_400/dspark/planning_packed_medusa_heads
# Again after 6c1f37f (a bias per position beside each temperature in the calibration)
python -m benchmarks.planning "drafters=[$RUNS/medusa/export]" "${PLAN[@]}" out=results/smollm2/families_400/dspark/planning_packed_medusa_bias
