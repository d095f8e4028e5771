#!/bin/bash
# DSpark, DFlash and EAGLE-3 as in ../families_400/dspark/run.sh (the same rows, cache, seed and settings), trained
# from scratch for 1,000 steps instead of 400, one after the other with 2 threads: does a longer budget move the
# block drafters towards EAGLE-3? Then their tau on the same prompts (compare.sh). About 70 minutes on 2 cores.
#   bash results/smollm2/families_1000/run.sh RUNS   (RUNS: a folder outside the repo; RUNS/cache is reused)
set -e
RUNS=${1:?usage: run.sh RUNS_DIR}
. "$(dirname "$0")/../families_400/settings.sh"
RUN="seed=18 trainer.max_steps=1000 trainer.val_every_n_steps=100 trainer.checkpoint_every_n_steps=100 trainer.num_threads=2 logger=none"
REPORT="serve_eval.ks=[2] serve_eval.plan=false"  # the closing report at one K: compare.sh serves the table

[ -d $CACHE ] || python -m train.hidden_cache conf=eagle3_smollm2 $ROWS trainer.num_threads=2
python train.py conf=dspark_pycode $DATA $RUN drafter.draft_vocab_size=8192 drafter.markov_rank=256 'serve_eval.ks=[8]' hydra.run.dir=$RUNS/dspark_1000
python train.py conf=dflash_pycode $DATA $RUN drafter.draft_vocab_size=8192 $REPORT hydra.run.dir=$RUNS/dflash_1000
python train.py conf=eagle3_smollm2 $ROWS $RUN $REPORT hydra.run.dir=$RUNS/eagle3_1000
