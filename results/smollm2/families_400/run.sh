#!/bin/bash
# The family table at 400 steps: six drafters from scratch on the same rows (regenerated conversations
# 8,193-11,200 of data/sharegpt-smollm2), the same seed and schedule, then one compare on the same
# 24 MT-bench first turns in chains and, where the family has them, trees. About 2.5 hours on 2 cores.
#   bash results/smollm2/families_400/run.sh RUNS   (RUNS: a folder outside the repo, about 6 GB)
set -e
RUNS=${1:?usage: run.sh RUNS_DIR}
. "$(dirname "$0")/settings.sh"

python -m train.hidden_cache conf=eagle3_smollm2 $ROWS trainer.num_threads=2
python train.py conf=eagle3_smollm2 $ROWS $RUN hydra.run.dir=$RUNS/eagle3
python train.py conf=eagle3_smollm2 $ROWS $RUN drafter.fc_norm=true drafter.norm_output=true hydra.run.dir=$RUNS/eagle31
python train.py conf=eagle $DATA $RUN hydra.run.dir=$RUNS/eagle1
python train.py conf=peagle $DATA $RUN drafter.draft_vocab_size=8192 hydra.run.dir=$RUNS/peagle
python train.py conf=medusa $DATA $RUN 'target.layer_ids=[2,15,27]' hydra.run.dir=$RUNS/medusa  # the cache's layers
python train.py conf=dflash_pycode $DATA $RUN drafter.draft_vocab_size=8192 hydra.run.dir=$RUNS/dflash8

python -m benchmarks.compare drafters=[$RUNS/eagle3/export,$RUNS/eagle31/export,$RUNS/eagle1/export,$RUNS/peagle/export,$RUNS/medusa/export,$RUNS/dflash8/export] \
  modes=[chain,tree] eval=mtbench eval.turns=1 eval.num_prompts=24 max_new_tokens=128 repeats=1 out=results/smollm2/families_400
# the same compare on the packed target the drafters were trained against (results/smollm2/families_400/packed/)
python -m benchmarks.compare drafters=[$RUNS/eagle3/export,$RUNS/eagle31/export,$RUNS/eagle1/export,$RUNS/peagle/export,$RUNS/medusa/export,$RUNS/dflash8/export] \
  quant=gguf modes=[chain,tree] eval=mtbench eval.turns=1 eval.num_prompts=24 max_new_tokens=128 repeats=1 out=results/smollm2/families_400/packed
