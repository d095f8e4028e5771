# The 400-step family table's shared settings, sourced by its scripts after RUNS is set: the rows (regenerated
# conversations 8,193-11,200 of data/sharegpt-smollm2 through one hidden-state cache in RUNS/cache), the data and
# closing report of the recipes that are not conf=eagle3_smollm2, and one seed and schedule for every drafter.
CACHE=$RUNS/cache
ROWS="data.skip_examples=8192 data.max_examples=11200 data.hidden_states=cache data.cache_dir=$CACHE"
DATA="target=smollm2 quant=gguf data=messages data.path=data/sharegpt-smollm2 data.seq_len=512 data.batch_size=4 eval=mtbench eval.turns=1 eval.num_prompts=8 $ROWS trainer.precision=bf16-mixed optim.warmup_steps=10 serve_eval.every_n_steps=0"
RUN="seed=18 trainer.max_steps=400 trainer.val_every_n_steps=50 trainer.checkpoint_every_n_steps=50 trainer.num_threads=2 logger=none"
