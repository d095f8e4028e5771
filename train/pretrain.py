"""Pretraining the shipped default target: a small Llama on the Python standard library.

`python train.py conf=target_pretrain` trains a byte-level BPE tokenizer on the train split,
then a Llama-architecture causal LM (RMSNorm, RoPE, SwiGLU, grouped-query attention) on
packed sequences of it, and saves both with save_pretrained. `python -m benchmarks.target_card`
then measures the held-out loss and writes the model card.
"""

import copy
import json
import math
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common import corpus
from common.config import UserError, require
from train.callbacks import wall_time
from train.data import TextDataModule
from train.optim import OptimConfig, check_finite, configure
from train.recipes import ModelConfig, PretrainRecipe, UnlikelihoodConfig
from train.trainer import fit, leave_process_group, make_logger, make_trainer

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte string encodes; no unknown token) with EOS as its one special."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """Bytes of source text per token id. Byte-level BPE spells one byte per character."""
    lengths = torch.zeros(len(tokenizer), dtype=torch.float64)
    for token, i in tokenizer.get_vocab().items():
        lengths[i] = 0 if token in tokenizer.all_special_tokens else len(token)
    return lengths


def repeated_ngram_mask(tokens: torch.Tensor, n: int, start: int) -> torch.Tensor:
    """[batch, length] bool: True at positions >= `start` inside an n-gram that already occurred
    earlier in its row (the row's tokens before `start` count as earlier)."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for row, row_mask in zip(tokens.tolist(), mask):
        seen = set()
        for end in range(n, len(row) + 1):
            gram = tuple(row[end - n:end])
            if gram in seen:
                row_mask[max(end - n, start):end] = True
            seen.add(gram)
    return mask


def greedy_continuations(model, prefixes: torch.Tensor, length: int) -> torch.Tensor:
    """prefixes [batch, p] -> [batch, p + length]; EOS is suppressed so every row has `length` new tokens."""
    ones = torch.ones_like(prefixes)
    return model.generate(input_ids=prefixes, attention_mask=ones, max_new_tokens=length, min_new_tokens=length,
                          do_sample=False, pad_token_id=model.config.pad_token_id)


def unlikelihood_of_repeats(model, sequences: torch.Tensor, prefix_len: int, n: int) -> torch.Tensor:
    """-log(1 - p) summed over the continuation tokens inside repeated n-grams, per continuation token
    (so the penalty fades as the repetition does)."""
    repeated = repeated_ngram_mask(sequences, n, prefix_len)[:, prefix_len:]
    logits = model(input_ids=sequences).logits[:, prefix_len - 1:-1].float()
    p = logits.softmax(-1).gather(-1, sequences[:, prefix_len:, None]).squeeze(-1)
    return -(torch.log1p(-p.clamp(max=1 - 1e-5)) * repeated).sum() / repeated.numel()


def loss_in_bits_per_byte(model, rows: torch.Tensor, byte_lengths: torch.Tensor, batch_size: int = 8) -> tuple[float, float]:
    """(nats per token, bits per byte of source text) of `model` over packed `rows`."""
    nats, tokens, nbytes = 0.0, 0, 0.0
    with torch.no_grad():
        for batch in rows.split(batch_size):
            logits = model(input_ids=batch).logits[:, :-1].float()
            targets = batch[:, 1:]
            nats += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
            nbytes += byte_lengths[targets].sum().item()
    return nats / tokens, nats / math.log(2) / nbytes


class CausalLMModule(L.LightningModule):
    """Next-token pretraining of a transformers causal LM."""

    def __init__(self, model: LlamaForCausalLM, optim: OptimConfig, max_steps: int, byte_lengths: torch.Tensor,
                 unlikelihood: UnlikelihoodConfig | None = None):
        super().__init__()
        self.model, self.optim, self.max_steps = model, optim, max_steps
        self.unlikelihood = unlikelihood or UnlikelihoodConfig()
        self.register_buffer("byte_lengths", byte_lengths.float(), persistent=False)

    def training_step(self, batch, _):
        every = self.unlikelihood.every_n_steps
        if every and (self.global_step + 1) % every == 0:
            name, loss = "train/unlikelihood", self.unlikelihood_loss(batch["input_ids"])
        else:
            name, loss = "train/loss", self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        check_finite(loss, self.global_step + 1, self.trainer.default_root_dir)
        self.log(name, loss, prog_bar=True)
        return loss

    def unlikelihood_loss(self, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.unlikelihood
        sequences = greedy_continuations(self.model, ids[:, : cfg.prefix_len], cfg.continuation_len)
        return unlikelihood_of_repeats(self.model, sequences, cfg.prefix_len, cfg.ngram)

    def validation_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        loss = self.model(input_ids=ids, labels=ids).loss
        bits_per_byte = loss * (ids.shape[1] - 1) * ids.shape[0] / math.log(2) / self.byte_lengths[ids[:, 1:]].sum()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/bits_per_byte", bits_per_byte, prog_bar=True)
        if batch_idx == 0:  # one batch: how much the model repeats itself when it decodes greedily
            cfg = self.unlikelihood
            sequences = greedy_continuations(self.model, ids[:, : cfg.prefix_len], cfg.continuation_len)
            self.log("val/repeated_ngrams", repeated_ngram_mask(sequences, cfg.ngram, cfg.prefix_len)
                     [:, cfg.prefix_len:].float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return configure(list(self.model.parameters()), self.optim, self.max_steps)



def prepare_tokenizer(run_dir: Path, files, vocab_size: int, init_from: str | None) -> PreTrainedTokenizerFast:
    """Train the tokenizer once per run directory (or take init_from's); a resumed run reuses it."""
    path = run_dir / "tokenizer"
    if path.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(path)
    if init_from:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(init_from)
        require(len(tokenizer) == vocab_size, "model.vocab_size", vocab_size, f"{len(tokenizer)}, init_from's vocabulary")
    else:
        tokenizer = train_tokenizer(files["train"]["text"], vocab_size)
    tokenizer.save_pretrained(path)
    return tokenizer


def build_model(cfg: ModelConfig, tokenizer, init_from: str | None = None) -> LlamaForCausalLM:
    config = LlamaConfig(**vars(cfg), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    if init_from:  # continue an earlier run's model; its bf16 weights become fp32 to train
        saved = LlamaForCausalLM.from_pretrained(init_from, torch_dtype=torch.float32)
        try:
            model.load_state_dict(saved.state_dict())
        except RuntimeError as e:
            raise UserError(f"init_from={init_from}: its architecture differs from model.* ({str(e).splitlines()[1].strip()})") from None
    return model


def earlier_training(init_from: str | None) -> dict:
    """The training facts of the model this run continues (zeros for a run from scratch)."""
    if not init_from:
        return {"tokens_seen": 0, "wall_time_s": 0}
    return json.loads((Path(init_from) / "training.json").read_text())


def save_target(module: CausalLMModule, tokenizer, files, out: Path, tokens_seen: int, wall_time_s: float, data_cfg,
                earlier: dict | None = None, how: dict | None = None) -> None:
    """save_pretrained in bf16 (half the bytes on disk; load it in fp32 on CPUs), plus training facts."""
    model = module.model
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_tokens = {s: int(sum(len(ids) + 1 for ids in tokenizer(list(files[s]["text"]))["input_ids"])) for s in corpus.SPLITS}
    facts = {
        "corpus": {
            "source": corpus.STDLIB_SOURCE,
            "include_tests": data_cfg.include_tests,
            "files": {s: len(files[s]) for s in corpus.SPLITS},
            "bytes": {s: sum(len(t.encode()) for t in files[s]["text"]) for s in corpus.SPLITS},
            "tokens": n_tokens,
            "content_hash": corpus.corpus_hash(files),
        },
        "seq_len": data_cfg.seq_len,
        "tokens_seen": tokens_seen + earlier.get("tokens_seen", 0) if earlier else tokens_seen,
        "wall_time_s": round(wall_time_s) + (earlier.get("wall_time_s", 0) if earlier else 0),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    facts.update(how or {})  # how this run trained beyond next-token loss (unlikelihood steps)
    if earlier and earlier.get("tokens_seen"):
        facts["continued_from"] = earlier  # the run this one started from, with its own facts
    (out / "training.json").write_text(json.dumps(facts, indent=2))


def run_pretrain(recipe: PretrainRecipe, run_dir: Path) -> None:
    files = corpus.stdlib_files(recipe.data.stdlib_path, recipe.data.include_tests)
    tokenizer = prepare_tokenizer(run_dir, files, recipe.model.vocab_size, recipe.init_from)
    datamodule = TextDataModule(recipe.data, files, tokenizer, recipe.seed)
    module = CausalLMModule(build_model(recipe.model, tokenizer, recipe.init_from), recipe.optim, recipe.trainer.max_steps,
                            token_byte_lengths(tokenizer), recipe.unlikelihood)
    # Unlikelihood steps trade a little validation loss for less repetition, so its runs ship their last weights.
    monitor = None if recipe.unlikelihood.every_n_steps else "val/loss"
    trainer = make_trainer(recipe.trainer, make_logger(recipe.logger, run_dir, asdict(recipe)), run_dir, monitor=monitor)
    fit(trainer, module, datamodule, recipe.resume)
    leave_process_group()  # the last collective
    if not trainer.is_global_zero:
        return  # one process saves the model
    steps = trainer.global_step
    best = next((c.best_model_path for c in trainer.checkpoint_callbacks if c.monitor), None)
    if best:  # ship the checkpoint with the lowest validation loss, not merely the last
        checkpoint = torch.load(best, map_location="cpu", weights_only=True)
        module.load_state_dict(checkpoint["state_dict"])
        steps = checkpoint["global_step"]
    every = recipe.unlikelihood.every_n_steps
    unlikelihood_steps = steps // every if every else 0
    tokens_seen = ((steps - unlikelihood_steps) * recipe.trainer.accumulate_grad_batches * recipe.data.batch_size
                   * recipe.data.seq_len)  # next-token steps only: an unlikelihood step reads a prefix, not a row
    how = {"unlikelihood": {**asdict(recipe.unlikelihood), "steps": unlikelihood_steps,
                            "next_token_steps": steps - unlikelihood_steps}} if unlikelihood_steps else {}
    save_target(module, tokenizer, files, run_dir / "model", tokens_seen, wall_time(trainer), recipe.data,
                earlier_training(recipe.init_from), how)
    print(f"target saved to {run_dir / 'model'}; measure it with: python -m benchmarks.target_card model_dir={run_dir / 'model'}")
