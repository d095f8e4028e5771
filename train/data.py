"""Training data: packed sequences of a corpus (speculators.corpus) and the DataModule."""

from dataclasses import dataclass

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from speculators.config import UserError, at_least, one_of


@dataclass
class DataConfig:
    source: str = "stdlib"  # the only source so far: the Python standard library
    stdlib_path: str | None = None  # None: sysconfig's stdlib of the running Python
    include_tests: bool = False  # the stdlib's test/ folders: 61% of tokens, very repetitive
    seq_len: int = 256
    batch_size: int = 8
    max_val_sequences: int = 32

    def __post_init__(self):
        one_of("data.source", self.source, ("stdlib",))
        at_least(8, data__seq_len=self.seq_len)
        at_least(1, data__batch_size=self.batch_size, data__max_val_sequences=self.max_val_sequences)


def pack(files: datasets.Dataset, tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise every file, end each with EOS, concatenate, cut into [n, seq_len] rows."""
    eos = tokenizer.eos_token_id
    tokenized = files.map(
        lambda batch: {"ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]},
        batched=True, remove_columns=files.column_names, desc="tokenising",
    )
    stream = torch.tensor([t for ids in tokenized["ids"] for t in ids], dtype=torch.long)
    n = len(stream) // seq_len
    if n == 0:
        raise UserError(f"{len(stream)} tokens do not fill one sequence of {seq_len}")
    return stream[: n * seq_len].view(n, seq_len)


class EndlessShuffle(IterableDataset):
    """Rows in a fresh seeded order each epoch, without end, starting after `skip` rows.

    The order is a function of (seed, epoch) only, so a resumed run that skips the rows it
    has already consumed sees exactly the batches an uninterrupted run would.
    """

    def __init__(self, rows: torch.Tensor, seed: int, skip: int = 0):
        self.rows, self.seed, self.skip = rows, seed, skip

    def __iter__(self):
        epoch, start = divmod(self.skip, len(self.rows))
        while True:
            order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            for i in order[start:].tolist():
                yield {"input_ids": self.rows[i], "loss_mask": torch.ones_like(self.rows[i])}
            epoch, start = epoch + 1, 0


class TextDataModule(L.LightningDataModule):
    """Packed sequences of the corpus; its state (rows consumed) makes resume exact."""

    def __init__(self, cfg: DataConfig, files: datasets.DatasetDict, tokenizer, seed: int):
        super().__init__()
        self.cfg, self.files, self.tokenizer, self.seed = cfg, files, tokenizer, seed
        self.rows_consumed = 0
        self.train_rows = self.val_rows = None

    def setup(self, stage: str) -> None:
        if self.train_rows is None:
            self.train_rows = pack(self.files["train"], self.tokenizer, self.cfg.seq_len)
            self.val_rows = pack(self.files["validation"], self.tokenizer, self.cfg.seq_len)[: self.cfg.max_val_sequences]

    def train_dataloader(self) -> DataLoader:
        # In-memory rows need no worker processes (which would each replay the stream).
        return DataLoader(EndlessShuffle(self.train_rows, self.seed, self.rows_consumed), batch_size=self.cfg.batch_size)

    def val_dataloader(self) -> DataLoader:
        val = [{"input_ids": r, "loss_mask": torch.ones_like(r)} for r in self.val_rows]
        return DataLoader(val, batch_size=self.cfg.batch_size)

    def state_dict(self) -> dict:
        # Checkpoints are written at optimizer-step boundaries, so this is exact.
        trainer = self.trainer
        return {"rows_consumed": trainer.global_step * trainer.accumulate_grad_batches * self.cfg.batch_size}

    def load_state_dict(self, state: dict) -> None:
        self.rows_consumed = state["rows_consumed"]
