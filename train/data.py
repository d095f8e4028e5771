"""Training data: the Python standard library corpus, packed sequences, and the DataModule.

The default corpus is the source of the running Python's standard library, which every
machine has offline. Files are split by a hash of their relative path, so the split never
depends on the machine, the order of the walk or a seed: test files are never trained on,
by the target's pretraining or by any drafter.
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from speculators.config import UserError

SPLITS = ("train", "validation", "test")
TEST_DIRS = {"test", "tests", "idle_test"}  # the stdlib's own test suites


@dataclass
class DataConfig:
    source: str = "stdlib"  # the only source so far: the Python standard library
    stdlib_path: str | None = None  # None: sysconfig's stdlib of the running Python
    include_tests: bool = False  # the stdlib's test/ folders: 61% of tokens, very repetitive
    seq_len: int = 256
    batch_size: int = 8
    max_val_sequences: int = 32


def split_of(relpath: str) -> str:
    """train / validation / test (90/5/5) from a hash of the file's relative path."""
    bucket = int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % 100
    return "test" if bucket < 5 else "validation" if bucket < 10 else "train"


def stdlib_files(stdlib_path: str | None = None, include_tests: bool = False) -> datasets.DatasetDict:
    """The .py files of the standard library (site-packages excluded), split by path hash."""
    root = Path(stdlib_path or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UserError(f"stdlib path {root} is not a directory")
    rows = {split: {"path": [], "text": []} for split in SPLITS}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        folders = set(rel.parts[:-1])
        if "site-packages" in folders or "dist-packages" in folders:
            continue
        if not include_tests and folders & TEST_DIRS:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            rows[split_of(rel.as_posix())]["path"].append(rel.as_posix())
            rows[split_of(rel.as_posix())]["text"].append(text)
    if not any(rows[s]["path"] for s in SPLITS):
        raise UserError(f"no .py files found under {root}")
    for split in SPLITS:
        if not rows[split]["path"]:
            raise UserError(f"the {split} split of {root} is empty ({sum(len(r['path']) for r in rows.values())} files in all)")
    return datasets.DatasetDict({s: datasets.Dataset.from_dict(rows[s]) for s in SPLITS})


def corpus_hash(files: datasets.DatasetDict) -> str:
    """A content hash of the corpus, so a model card says exactly what it was trained on."""
    h = hashlib.sha256()
    for split in SPLITS:
        for path, text in zip(files[split]["path"], files[split]["text"]):
            h.update(path.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


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
