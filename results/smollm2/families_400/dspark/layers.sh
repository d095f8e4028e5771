#!/bin/bash
# DSpark and DFlash with N draft layers (3, or the references' 5: DeepSpec gives block drafters five against
# EAGLE-3's one), on run.sh's rows, seed and schedule; then their tau beside run.sh's one-layer DSpark and EAGLE-3
# on the same prompts (both turns of 16 MT-bench conversations, 6 ShareGPT test conversations), greedy, packed
# target. Results in layers/ (N=3) or layers_N/.
#   bash results/smollm2/families_400/dspark/layers.sh RUNS [N]   (RUNS: run.sh's folder, its cache and drafters)
set -e
RUNS=${1:?usage: layers.sh RUNS_DIR}
. "$(dirname "$0")/../settings.sh"
N=${2:-3}
LAYERS=drafter.num_layers=$N
[ -d $CACHE ] || python -m train.hidden_cache conf=eagle3_smollm2 $ROWS trainer.num_threads=2
python train.py conf=dspark_pycode $DATA $RUN $LAYERS drafter.draft_vocab_size=8192 drafter.markov_rank=256 'serve_eval.ks=[8]' hydra.run.dir=$RUNS/dspark_l$N
python train.py conf=dflash_pycode $DATA $RUN $LAYERS drafter.draft_vocab_size=8192 'serve_eval.ks=[2]' serve_eval.plan=false hydra.run.dir=$RUNS/dflash_l$N
OUT=results/smollm2/families_400/dspark/layers$([ $N = 3 ] || echo _$N)
DRAFTERS="drafters=[$RUNS/dspark_l$N/export,$RUNS/dflash_l$N/export,$RUNS/eagle3/export,$RUNS/dspark/export]"
python -m benchmarks.compare "$DRAFTERS" quant=gguf eval=mtbench eval.turns=2 eval.num_prompts=16 max_new_tokens=96 repeats=1 out=$OUT/mtbench
python -m benchmarks.compare "$DRAFTERS" quant=gguf eval=sharegpt eval.num_prompts=6 max_new_tokens=96 repeats=1 out=$OUT/sharegpt
