"""Runs inside vLLM's speculators 0.9.0 venv (benchmarks/peers/speculators_peer.py makes it); never imports
this project. Three stages, each standing in for what speculators does with a vLLM server or a GPU:

    python speculators_worker.py data ROWS OUT TARGET SEQ_LEN ~ `speculators prepare-data` (rows already rendered and masked)
    python speculators_worker.py hidden OUT TARGET L... ~ `speculators generate-offline-data`, transformers on the CPU
    python speculators_worker.py train ARGS...        = `speculators train ARGS...` with CPU patches in-process
    python speculators_worker.py logits CKPT OUT      its DSpark's logits on random inputs, for our reader to match
"""

import json
import os
import sys
import time
from pathlib import Path

import torch


def data(rows_file: str, out: str, target: str, seq_len: str) -> None:
    """OUT: a datasets folder (train rows then validation rows) through speculators' own pass-through for
    tokenised rows, token_freq.pt (train rows), split.json with the train_data_ratio that puts its train/val
    boundary between them. With no validation row, the last train row doubles as one (speculators always
    holds out the tail)."""
    from datasets import Dataset, concatenate_datasets
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.vocab_mapping import save_token_frequency_distribution
    from transformers import AutoTokenizer

    folder = Path(out)
    if any(folder.glob("*.arrow")):
        return
    rows = json.loads(Path(rows_file).read_text())
    tok = AutoTokenizer.from_pretrained(target)
    parts = {}
    for name in ("train", "validation"):
        raw = Dataset.from_dict({"input_ids": [r[0] for r in rows[name]], "loss_mask": [r[1] for r in rows[name]]})
        parts[name] = build_speculator_training_dataset(raw, tok, max_length=int(seq_len), num_proc=1)
    if len(parts["validation"]) == 0:
        parts["validation"] = parts["train"].select([len(parts["train"]) - 1])
    n_train, n_val = len(parts["train"]), len(parts["validation"])
    ds = concatenate_datasets([parts["train"], parts["validation"]])
    ds.set_format(type="torch")
    folder.mkdir(parents=True, exist_ok=True)
    ds.save_to_disk(str(folder))
    save_token_frequency_distribution(parts["train"], folder / "token_freq.pt")
    info = {"train_rows": n_train, "val_rows": n_val, "train_data_ratio": (n_train + 0.5) / (n_train + n_val),
            "train_tokens": int(sum(int(x) for x in parts["train"]["seq_len"]))}
    (folder / "split.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info), flush=True)


def hidden(out: str, target: str, *layers: str) -> None:
    """OUT/hidden_states/hs_{i}.safetensors for row i, as speculators' FileTransfer reads them: token_ids [T] and
    hidden_states [T, k+1, H] bf16 = HF hidden_states[l] for each layer l (the input of decoder layer l), then
    the last layer's output before the final norm (speculators applies the norm and lm_head itself)."""
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ds, folder = load_from_disk(out), Path(out) / "hidden_states"
    folder.mkdir(exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    captured = {}
    model.model.norm.register_forward_pre_hook(lambda module, args: captured.__setitem__("pre_norm", args[0]))
    dtype = getattr(torch, os.environ.get("HIDDEN_DTYPE", "bfloat16"))
    start, done, tokens = time.time(), 0, 0
    with torch.inference_mode():
        for i in range(len(ds)):
            path = folder / f"hs_{i}.safetensors"
            if path.exists():
                continue
            ids = ds[i]["input_ids"].long()
            o = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            hs = torch.stack([o.hidden_states[int(layer)][0] for layer in layers] + [captured["pre_norm"][0]], dim=1)
            save_file({"hidden_states": hs.to(dtype).contiguous(), "token_ids": ids.contiguous()}, str(path.with_suffix(".tmp")))
            path.with_suffix(".tmp").rename(path)
            done, tokens = done + 1, tokens + len(ids)
    print(f"hidden states: {done} rows, {tokens} tokens in {time.time() - start:.1f} s", flush=True)


def train(argv: list[str]) -> None:
    """speculators.train.cli.main(TrainConfig.resolve(argv)) after these patches (site-packages untouched):
    without an accelerator (1) the single-process trainer's `.to(local_rank)` (cuda:0) goes to the CPU,
    (2) autocast runs on "cpu" (its "cuda" fallback is disabled and leaves bf16 inputs against fp32 weights),
    (3) torch.accelerator.synchronize (its step timer) is a no-op, (4) checkpoints load to the CPU; always
    (5) --max-steps ends the run (0.9.0 starts every later epoch anyway and adds a step each), (6) the final
    weights are saved as SAVE_PATH/final, (7) ADAMW_BETAS="b1,b2" sets AdamW's betas (no flag for them),
    (8) each step's seconds and packed non-padding tokens are summarised in one [train_cpu] line."""
    import speculators.train.checkpointer as checkpointer
    import speculators.train.data as sdata
    import speculators.train.optimizers as optimizers
    import speculators.train.trainer as trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    cpu = not torch.accelerator.is_available()
    trainers, steps, state = [], [], {"last": 0.0, "tokens": 0}

    class MaxSteps(Exception):
        pass

    if cpu:
        trainer.get_local_rank = lambda: "cpu"  # 1
        checkpointer.get_current_device = lambda: "cpu"  # 4
        torch.accelerator.synchronize = lambda *a, **k: None  # 3
    if os.environ.get("ADAMW_BETAS"):  # 7
        betas = tuple(float(b) for b in os.environ["ADAMW_BETAS"].split(","))

        class AdamW(torch.optim.AdamW):
            def __init__(self, params, **kwargs):
                super().__init__(params, **({"betas": betas} | kwargs))

        optimizers.torch.optim.AdamW = AdamW
    init, train_epoch, collate = trainer.Trainer.__init__, trainer.Trainer.train_epoch, sdata.CollateFn.__call__

    def init_patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if cpu:
            self.device_type = "cpu"  # 2
        trainers.append(self)

    def train_epoch_patched(self, epoch, **kwargs):
        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            raise MaxSteps  # 5

        def on_step():  # 8
            now = time.perf_counter()
            steps.append((now - state["last"], state["tokens"]))
            state["last"] = now

        state["last"] = time.perf_counter()
        return train_epoch(self, epoch, step_callback=on_step, **kwargs)

    def collate_patched(self, batch):
        out = collate(self, batch)
        state["tokens"] = int((out["document_ids"] != -1).sum())  # with --num-workers 0: the batch being trained
        return out

    trainer.Trainer.__init__, trainer.Trainer.train_epoch = init_patched, train_epoch_patched
    sdata.CollateFn.__call__ = collate_patched
    start = time.perf_counter()
    try:
        main(TrainConfig.resolve(argv))
    except MaxSteps:
        pass
    if trainers:  # 6
        trainers[-1].maybe_save_checkpoint("final")
    if steps:
        secs = [s for s, _ in steps]
        rest = secs[1:] or secs
        print(f"[train_cpu] {len(steps)} steps; seconds/step: first {secs[0]:.2f}, mean of the rest "
              f"{sum(rest) / len(rest):.2f}; tokens/step (packed, prompts included): "
              f"{sum(t for _, t in steps) / len(steps):.0f}; process {time.perf_counter() - start:.1f} s", flush=True)


def logits(checkpoint: str, out: str, anchors: str = "4", length: str = "64") -> None:
    """OUT (safetensors): a DSpark checkpoint's Markov-biased logits and confidence logits, fp32, for `anchors`
    blocks drawn by its own code on random features and tokens (one document, every token trained), with
    those inputs and the anchors, as its training forward computes them before the loss."""
    from safetensors.torch import save_file
    from speculators.models.dspark import DSparkDraftModel

    model = DSparkDraftModel.from_pretrained(checkpoint).float().eval()
    model.load_verifier_weights()  # embed_tokens and the verifier's head: left out of its checkpoint
    T, A, B = int(length), int(anchors), model.block_size
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, T, len(model.target_layer_ids) * model.hidden_size, generator=generator)
    ids = torch.randint(0, model.verifier_vocab_size, (1, T), generator=generator)
    ones, last = torch.ones(1, T, dtype=torch.long), torch.randn(1, T, model.hidden_size, generator=generator)
    torch.manual_seed(0)
    with torch.no_grad():
        hidden, base, _, _, index = model._backbone_forward(features, ids, ones, last, ones - 1, max_anchors=A)
        tokens, hidden = ids[0, index].view(A, B), hidden.view(A, B, -1)  # sample_from_anchor: slot k follows token k
        prev = model.markov_head.prev_embeddings(tokens)
        biased = base.view(A, B, -1) + model.markov_head.block_bias(prev_token_ids=tokens, hidden_states=hidden, prev_emb=prev)
        confidence = model.confidence_head(torch.cat([hidden, prev], -1))
    save_file({"features": features, "input_ids": ids, "anchors": index.view(A, B)[:, 0].contiguous(),
               "logits": biased.contiguous(), "confidence": confidence.contiguous()}, out)


if __name__ == "__main__":
    stage, args = sys.argv[1], sys.argv[2:]
    {"data": lambda: data(*args), "hidden": lambda: hidden(*args), "train": lambda: train(args),
     "logits": lambda: logits(*args)}[stage]()
