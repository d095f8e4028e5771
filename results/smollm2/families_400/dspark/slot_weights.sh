#!/bin/bash
# The block drafters' loss weights by slot, and DSpark's recurrent Markov head, on run.sh's rows, seed and 400
# steps: at this budget the first draft decides tau (accepted 20% against 3% for the second), so DSpark and
# DFlash are trained again with gamma=1 (slot k weighs exp(-(k-1)), the first slot 58% of the loss against 26%
# with the default gamma=4), and DSpark once more with markov_head_type=rnn. Then their tau beside run.sh's
# drafters on both turns of 16 MT-bench conversations, greedy, packed target. One thread (other work beside).
#   bash results/smollm2/families_400/dspark/slot_weights.sh RUNS   (RUNS: run.sh's folder, its cache and drafters)
set -e
RUNS=${1:?usage: slot_weights.sh RUNS_DIR}
. "$(dirname "$0")/../settings.sh"
RUN=${RUN/num_threads=2/num_threads=1}
export OMP_NUM_THREADS=1
SPARK="drafter.draft_vocab_size=8192 drafter.markov_rank=256 serve_eval.ks=[8]"
[ -d $RUNS/dspark_g1 ] || python train.py conf=dspark_pycode $DATA $RUN $SPARK drafter.gamma=1 hydra.run.dir=$RUNS/dspark_g1
[ -d $RUNS/dflash_g1 ] || python train.py conf=dflash_pycode $DATA $RUN drafter.draft_vocab_size=8192 drafter.gamma=1 'serve_eval.ks=[2]' serve_eval.plan=false hydra.run.dir=$RUNS/dflash_g1
[ -d $RUNS/dspark_rnn ] || python train.py conf=dspark_pycode $DATA $RUN $SPARK drafter.markov_head_type=rnn hydra.run.dir=$RUNS/dspark_rnn
DRAFTERS="drafters=[$RUNS/dspark_g1/export,$RUNS/dflash_g1/export,$RUNS/dspark_rnn/export,$RUNS/dspark/export,$RUNS/dflash8/export,$RUNS/eagle3/export]"
python -m benchmarks.compare "$DRAFTERS" quant=gguf eval=mtbench eval.turns=2 eval.num_prompts=16 max_new_tokens=96 repeats=1 out=results/smollm2/families_400/dspark/slot_weights/mtbench
python -m benchmarks.compare "$DRAFTERS" quant=gguf eval=sharegpt eval.num_prompts=6 max_new_tokens=96 repeats=1 out=results/smollm2/families_400/dspark/slot_weights/sharegpt
