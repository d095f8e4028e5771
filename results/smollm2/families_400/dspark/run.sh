#!/bin/bash
# DSpark in the 400-step family table: DSpark, DFlash and EAGLE-3 from scratch on the same rows as ../run.sh
# (regenerated conversations 8,193-11,200 of data/sharegpt-smollm2 through one hidden-state cache), seed and
# schedule, one after the other with 2 threads. Then their tau on the same prompts (compare.sh) and their speed
# with cost-aware verification (planning.sh).
#   bash results/smollm2/families_400/dspark/run.sh RUNS   (RUNS: a folder outside the repo, about 6 GB)
set -e
RUNS=${1:?usage: run.sh RUNS_DIR}
. "$(dirname "$0")/../settings.sh"
REPORT="serve_eval.ks=[2] serve_eval.plan=false"  # the closing report at one K: compare.sh serves the table

[ -d $CACHE ] || python -m train.hidden_cache conf=eagle3_smollm2 $ROWS trainer.num_threads=2
python train.py conf=dspark_pycode $DATA $RUN drafter.draft_vocab_size=8192 drafter.markov_rank=256 'serve_eval.ks=[8]' hydra.run.dir=$RUNS/dspark
python train.py conf=dflash_pycode $DATA $RUN drafter.draft_vocab_size=8192 $REPORT hydra.run.dir=$RUNS/dflash8
python train.py conf=eagle3_smollm2 $ROWS $RUN $REPORT hydra.run.dir=$RUNS/eagle3
# DSpark again with four times the blocks per row (128 anchors of 512 tokens, every fourth position): about
# EAGLE-3's compute a step, on the same rows.
python train.py conf=dspark_pycode $DATA $RUN drafter.draft_vocab_size=8192 drafter.markov_rank=256 drafter.anchors=128 'serve_eval.ks=[8]' hydra.run.dir=$RUNS/dspark_a128
