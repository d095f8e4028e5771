"""The hidden-state cache: run the frozen target once over the training data, keep what the
drafter's loss reads from it, and train many drafters from that without the target's layers.

    python -m train.hidden_cache conf=eagle3_pycode data.hidden_states=cache data.cache_dir=cache/pycode
    python train.py conf=eagle3_pycode data.hidden_states=cache data.cache_dir=cache/pycode serve_eval.every_n_steps=0

Both commands take the same config: the cache holds the rows of the train and validation splits
as the data module builds them. Per row of seq_len tokens a shard stores `hidden`
[rows, len(layer_ids) + 1, seq_len, H]: hidden_states[k] for each layer id, then hidden_states[L]
(after the final norm), and `greedy` [rows, seq_len], the target's argmax (int32). Logits are not stored: they
are lm_head(hidden_states[L]), which the target's lm_head recomputes in training (V/H times fewer bytes: 31x for Llama 3 8B; a
check on the first batch refuses a target whose logits are more than that, e.g. soft-capped), and with the argmax
stored only for the vocab ids a drafter reads (its draft vocab: on SmolLM2 a sixth of lm_head's product a step).
float8_e4m3 scales each token's vector of each layer by its absmax / 448 (`scale`, float32).

data.cache_engine=vllm computes the states with vLLM instead (engines/vllm_runner.py --hidden in vLLM's venv, one
worker per visible GPU, batches dealt between them): its extract_hidden_states method, as speculators' data
generation uses it; our process keeps only the target's embeddings, final norm and lm_head (the norm finishes
vLLM's last-layer output, lm_head gives the argmax) and writes the same shards. vLLM runs the target's Hugging
Face folder (a GGUF target's converted one), so the target must be served as stored: quant.scheme none or gguf.

A build writes into <cache_dir>.partial and records each finished shard (about 1 GiB), with a
fingerprint of the token rows it holds, in its progress.json. A shard whose rows an earlier build
already holds is taken from it: stopped, the same command resumes where it was; rebuilt with
overwrite=true for a folder grown by train/regenerate.py (a larger data.max_examples), only the new
rows are computed, since whole examples are packed in order and the old rows come first.

index.json records what the cache was built from; training refuses a cache whose target
weights, layer ids, quantization, data rows, storage dtype or seq_len differ from its own. The target is told
apart by its embeddings and lm_head (target_fingerprint) and by sampled rows of every weight in its files
(layers_fingerprint: a fine-tune of the decoder layers alone has the same embeddings).

Every shard, progress.json and index.json is written whole or not at all (a temporary file, fsynced, renamed
into place). index.json records each shard's size and sha256 (hashed from the bytes as they are written):
training checks every shard's size when it opens the cache and its checksum when it first reads from it (about
0.6 s per GiB here, once per shard and process), and refuses a missing, truncated or damaged shard in one line.
A rebuild with overwrite=true checks the shards it would keep the same way and recomputes only the bad ones.
A cache from before these checksums is refused, asking for a rebuild.
"""

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import hydra
import torch
from huggingface_hub import snapshot_download
from omegaconf import DictConfig
from safetensors import safe_open
from safetensors.torch import save

from common import progress as shown
from common.config import PROJECT_ROOT, UserError, exit_on_user_error, run_cli, to_dataclass
from common.files import write_atomically
from engines import vllm_venv
from speculators import gguf_file
from speculators.export import check_writable, move_into_place
from speculators.target import FrozenTarget, check_logits_from_hidden, check_logits_known
from train.data import TextDataModule, check_context, load_examples
from train.recipes import DrafterRecipe

STORED = {"bfloat16": torch.bfloat16, "float8_e4m3": torch.float8_e4m3fn, "float32": torch.float32}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SHARD_BYTES = 1 << 30
SETTINGS = ("target_fingerprint", "layers_fingerprint", "layer_ids", "quant", "dtype", "seq_len")  # what a shard's
# bytes depend on
CHECKED = (*SETTINGS, "data_fingerprint")
CHECKSUM = "sha256"  # 1.7 GiB/s here with the CPU's SHA instructions (blake2b: 1.2)
SAMPLED_ROWS = 16  # rows of each weight layers_fingerprint reads
REBUILD = "rebuild it with `python -m train.hidden_cache`, this run's config and overwrite=true"


def identity(recipe, target: FrozenTarget, data: TextDataModule) -> dict:
    """What a cache must have been built from to stand in for this run's target."""
    rows = hashlib.sha256()
    for tensor in (data.train_rows, data.train_mask, data.val_rows, data.val_mask):
        rows.update(tensor.contiguous().numpy().tobytes())
    return {"target": target.name_or_path, "target_fingerprint": target.fingerprint(),
            "layers_fingerprint": layers_fingerprint(recipe.target), "layer_ids": target.layer_ids,
            "quant": asdict(recipe.quant), "dtype": recipe.data.cache_dtype, "seq_len": recipe.data.seq_len,
            "data_fingerprint": rows.hexdigest()[:16]}


def layers_fingerprint(cfg) -> str:
    """A hash of SAMPLED_ROWS rows of every weight in the target's files (TargetConfig `cfg`), by name and float32
    value, so a re-sharded or re-saved copy of the same weights matches. Memory-mapped: the rows alone are read."""
    folder = weights_folder(cfg)
    files = sorted(folder.glob("*.safetensors")) if folder else []
    if not files:
        return "unknown (no safetensors weights)"
    digest, opened = hashlib.sha256(), {}
    for file in files:
        handle = safe_open(str(file), "pt")
        opened.update((name, handle) for name in handle.keys())
    for name in sorted(opened):
        digest.update(name.encode() + sampled_rows(opened[name].get_slice(name)).numpy().tobytes())
    return digest.hexdigest()[:16]


def sampled_rows(weight) -> torch.Tensor:
    """SAMPLED_ROWS evenly spaced rows of a safetensors slice (all of a 1-d or 0-d one), in float32."""
    shape = weight.get_shape()
    if len(shape) < 2:
        return weight[:].float().reshape(-1)
    step = max(1, shape[0] // SAMPLED_ROWS)
    return torch.cat([weight[i : i + 1] for i in range(0, shape[0], step)[:SAMPLED_ROWS]]).float()


def weights_folder(cfg) -> Path | None:
    """The folder holding the target's weight files: its own, the one its GGUF converts to, or the hub's snapshot."""
    if cfg.gguf_file:
        return gguf_file.converted_folder(cfg.gguf_file)
    if Path(cfg.name_or_path).is_dir():
        return Path(cfg.name_or_path)
    try:  # loaded already, so in the hub's cache
        return Path(snapshot_download(cfg.name_or_path, local_files_only=True, allow_patterns=["*.safetensors"]))
    except Exception:  # not cached (offline hub errors are of many kinds): nothing to read
        return None


def encode(hidden: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    if dtype != "float8_e4m3":
        return {"hidden": hidden.to(STORED[dtype]).contiguous()}
    scale = hidden.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return {"hidden": (hidden / scale).to(torch.float8_e4m3fn), "scale": scale.squeeze(-1).contiguous()}


def decode(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden = tensors["hidden"].float()
    return hidden * tensors["scale"].unsqueeze(-1) if "scale" in tensors else hidden


# Building ---------------------------------------------------------------------------------------

def build(recipe, device: str = "cpu") -> Path:
    """Write data.cache_dir (through a .partial folder renamed into place) and return it, taking the
    shards whose rows a stopped build or the cache it replaces already holds."""
    out = Path(recipe.data.cache_dir)
    check_writable(out, recipe.overwrite)
    vllm = recipe.data.cache_engine == "vllm"
    python = vllm_venv.venv_python(None, "or build with data.cache_engine=transformers") if vllm else None
    check_context(recipe.data, recipe.target)
    examples = load_examples(recipe.data)  # before the target: a bad data file is refused in seconds, not minutes
    target = FrozenTarget.load(recipe.target, recipe.quant, layers=not vllm).to(device)
    data = TextDataModule(recipe.data, examples, target.tokenizer, recipe.seed)
    data.setup("fit")
    built_from = identity(recipe, target, data)
    partial = out.with_name(out.name + ".partial")
    progress = Progress(partial, built_from, previous=out)
    row_values = (len(target.layer_ids) + 1) * recipe.data.seq_len * target.hidden_size
    splits = {"train": data.train_rows, "validation": data.val_rows}
    plan = shard_plan(splits, max(1, SHARD_BYTES // (row_values * STORED[recipe.data.cache_dtype].itemsize)))
    taken = [(len(rows), progress.reusable[fp][0].parent) for *_, rows, fp in plan if fp in progress.reusable]
    total = sum(len(rows) for rows in splits.values())
    if taken:
        sources = " and ".join(sorted({str(folder) for _, folder in taken}))
        print(f"hidden-state cache: {sum(n for n, _ in taken)} of {total} rows already built ({sources}), "
              "computing the rest")
    states = VLLMStates(recipe, target, python) if vllm else TargetStates(target)
    try:
        with shown.bar(total=total, unit="row", desc="hidden states") as bar:
            for split, name, rows, fingerprint in plan:
                if progress.take(split, name, fingerprint, len(rows)):
                    bar.update(len(rows))
                else:
                    write_shard(states, target, rows, recipe.data, progress, (split, name, fingerprint), bar)
    finally:
        states.close()
    progress.remove_unused()
    tokens = total * recipe.data.seq_len
    size = sum(shard["bytes"] for split in progress.shards.values() for shard in split)
    index = {**built_from, "engine": states.engine, "target_dtype": recipe.target.dtype, "hidden_size": target.hidden_size,
             "rows": {split: len(rows) for split, rows in splits.items()},
             "bytes": size, "bytes_per_token": size / tokens, "shards": progress.shards}
    write_atomically(partial / "index.json", json.dumps(index, indent=2).encode())
    progress.path.unlink()
    move_into_place(partial, out)
    print(f"hidden-state cache: {out}: {tokens} tokens in {size / 2**20:.1f} MiB, {size / tokens:.1f} bytes per token "
          f"({recipe.data.cache_dtype}, {len(target.layer_ids)} layers + the last)")
    return out


def rows_fingerprint(rows: torch.Tensor) -> str:
    """What a shard's hidden states depend on besides the settings: its rows' token ids, in order."""
    return hashlib.sha256(rows.contiguous().numpy().tobytes()).hexdigest()[:16]


def shard_plan(splits: dict[str, torch.Tensor], per_shard: int) -> list[tuple[str, str, torch.Tensor, str]]:
    """(split, file name, rows, rows fingerprint) of each shard: a split's rows in order, per_shard at a time."""
    plan = []
    for split, rows in splits.items():
        for number, start in enumerate(range(0, len(rows), per_shard)):
            chunk = rows[start : start + per_shard]
            fingerprint = rows_fingerprint(chunk)
            plan.append((split, f"{split}-{number:05d}-{fingerprint}.safetensors", chunk, fingerprint))
    return plan


def same_settings(record: dict | None, built_from: dict) -> bool:
    return record is not None and all(record.get(key) == built_from[key] for key in SETTINGS)


def read_record(path: Path) -> dict | None:
    """A progress.json or index.json, or None where there is none or it cannot be read (a build replaces it)."""
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError):  # ValueError: JSON or UTF-8
        return None
    return record if isinstance(record, dict) and isinstance(record.get("shards"), dict) else None


def save_shard(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """Write a shard atomically; its size and checksum, hashed from the bytes written, for the index."""
    data = save(tensors)
    write_atomically(path, data)
    return {"bytes": len(data), CHECKSUM: hashlib.new(CHECKSUM, data).hexdigest()}


def shard_problem(path: Path, record: dict, checksum: bool = True) -> str | None:
    """What is wrong with a shard file against its record (missing, another size, other bytes), or None."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{size} bytes where the index records {record['bytes']} (truncated?)"
    if checksum:
        with open(path, "rb") as f:
            if hashlib.file_digest(f, CHECKSUM).hexdigest() != record[CHECKSUM]:
                return f"damaged (its {CHECKSUM} is not the one the index records)"
    return None


class Progress:
    """The shards a build has finished in its .partial folder, recorded after each one, and the
    shards it may take instead of computing: those a stopped build with the same settings left in
    .partial, and those of the cache it replaces. A .partial built with other settings starts over."""

    def __init__(self, folder: Path, built_from: dict, previous: Path):
        self.folder, self.path, self.built_from = folder, folder / "progress.json", built_from
        stopped = read_record(self.path) or read_record(folder / "index.json")  # stopped before or after its index
        if not same_settings(stopped, built_from):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            stopped = None
        replaced = read_record(previous / "index.json")
        self.reusable: dict[str, tuple[Path, dict]] = {}  # rows fingerprint -> a shard file holding those rows
        for source, record in ((previous, replaced), (folder, stopped)):
            if same_settings(record, built_from):
                for shard in (shard for shards in record["shards"].values() for shard in shards):
                    if {"rows_fingerprint", "greedy", CHECKSUM} <= set(shard):  # caches built before these are rebuilt
                        self.reusable[shard["rows_fingerprint"]] = (source / shard["file"], shard)
        self.shards: dict[str, list[dict]] = {}

    def take(self, split: str, name: str, fingerprint: str, rows: int) -> bool:
        """Record the shard `name` from an earlier build of the same rows (hard-linked), if there is one and it is
        whole: a damaged shard is computed again."""
        source, record = self.reusable.get(fingerprint, (None, None))
        if source is None:
            return False
        problem = shard_problem(source, record)
        if problem:
            print(f"hidden-state cache: {source} is {problem}: computing it again")
            return False
        target = self.folder / name
        if source != target:
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except OSError:  # another file system
                shutil.copyfile(source, target)
        self.add(split, name, rows, fingerprint, {key: record[key] for key in ("bytes", CHECKSUM)})
        return True

    def add(self, split: str, name: str, rows: int, fingerprint: str, written: dict) -> None:
        """Record a finished shard with its size and checksum (`written`)."""
        shard = {"file": name, "rows": rows, "rows_fingerprint": fingerprint, "greedy": True, **written}
        self.shards.setdefault(split, []).append(shard)
        write_atomically(self.path, json.dumps({**self.built_from, "shards": self.shards}, indent=2).encode())

    def remove_unused(self) -> None:
        """Delete what a stopped build of other rows left in .partial."""
        used = {shard["file"] for shards in self.shards.values() for shard in shards} | {self.path.name}
        for file in self.folder.iterdir():
            if file.name not in used:
                file.unlink()


def write_shard(states, target: FrozenTarget, rows: torch.Tensor, cfg, progress: Progress, shard: tuple, bar) -> None:
    """Compute `rows`' hidden states batch by batch and save them and the target's argmax as one shard."""
    parts, greedy = [], []
    for aux_hidden, last_hidden in states(rows, cfg.batch_size):
        parts.append(torch.stack([*aux_hidden, last_hidden], 1).cpu())
        greedy.append(greedy_tokens(target, last_hidden).cpu())
        bar.update(len(last_hidden))
    split, name, fingerprint = shard
    written = save_shard(encode(torch.cat(parts), cfg.cache_dtype) | {"greedy": torch.cat(greedy)}, progress.folder / name)
    progress.add(split, name, len(rows), fingerprint, written)


class TargetStates:
    """The target as loaded computes each batch; on the build's first, also its logits, checked to be lm_head(its
    last hidden state), which the cache relies on."""

    engine = "transformers"

    def __init__(self, target: FrozenTarget):
        self.target, self.checked = target, False

    def __call__(self, rows: torch.Tensor, batch_size: int):
        """(aux_hidden, last_hidden) of each batch of `rows`, in order."""
        for batch in rows.split(batch_size):
            out = self.target(batch.to(self.target.device), logits="none" if self.checked else "all")
            if not self.checked:
                check_logits_recomputable(self.target, out)
                self.checked = True
            yield out.aux_hidden, out.last_hidden

    def close(self) -> None:
        """Nothing to release: the target belongs to the build, which keeps using its lm_head."""


class VLLMStates:
    """vLLM's workers (engines/vllm_runner.py --hidden) compute each batch: one per visible GPU, batches dealt
    between them in turn; each saves a batch's states to a file in a scratch folder that this reads back."""

    def __init__(self, recipe, target: FrozenTarget, python):
        check_vllm_serves_it(recipe, target)
        cfg = recipe.target
        self.target, self.scratch = target, Path(tempfile.mkdtemp(prefix="vllm-hidden-states-"))
        folder = gguf_file.converted_folder(cfg.gguf_file) if cfg.gguf_file else cfg.name_or_path
        engine = {"model": str(folder), "dtype": cfg.dtype, "max_model_len": recipe.data.seq_len + 1,
                  "max_num_seqs": recipe.data.batch_size, "seed": recipe.seed, "folder": str(self.scratch / "requests"),
                  "layers": [*target.layer_ids, target.num_layers]}  # the last: its output before the final norm
        threads = recipe.trainer.num_threads or torch.get_num_threads()
        try:
            self.workers = vllm_venv.start_workers(python, "--hidden", engine, threads, None, "data.cache_engine")
        except UserError:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise
        self.engine = f"vLLM {json.dumps(engine['layers'])} x {len(self.workers)} worker(s)"

    def __call__(self, rows: torch.Tensor, batch_size: int):
        batches = list(rows.split(batch_size))
        for start in range(0, len(batches), len(self.workers)):
            turn = list(zip(self.workers, batches[start : start + len(self.workers)]))
            for number, (worker, batch) in enumerate(turn):
                worker.send({"rows": batch.tolist(), "file": str(self.scratch / f"batch-{number}.safetensors")})
            for worker, _ in turn:
                path = Path(worker.receive()["file"])
                with safe_open(str(path), "pt") as f:
                    hidden = f.get_tensor("hidden").float()  # [rows, T, len(layer ids) + 1, H]
                path.unlink()
                yield list(hidden[:, :, :-1].unbind(2)), self.target.final_norm(hidden[:, :, -1])

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def check_vllm_serves_it(recipe, target: FrozenTarget) -> None:
    """vLLM runs the target's weights as stored, and its hidden states stand in for ours only if that is the
    target we train against, whose logits are lm_head(hidden_states[L])."""
    quant = recipe.quant
    if quant.scheme not in ("none", "gguf") or quant.activations != "exact":
        raise UserError(f"data.cache_engine=vllm runs the target as stored, not as quant.scheme={quant.scheme} "
                        f"(activations {quant.activations}) serves it; use data.cache_engine=transformers")
    check_logits_known(target, "train it with data.hidden_states=online")


def greedy_tokens(target: FrozenTarget, last_hidden: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """The target's argmax [B, T] (int32) from its last hidden states, `chunk` positions at a time: [chunk, V]
    logits at most (a batch of Llama 3's at once would be gigabytes)."""
    flat = last_hidden.flatten(0, 1)
    tokens = torch.cat([target.head_logits(part).argmax(-1) for part in flat.split(chunk)])
    return tokens.view(last_hidden.shape[:2]).to(torch.int32)


def check_logits_recomputable(target: FrozenTarget, out) -> None:
    check_logits_from_hidden(target, out, "train it with data.hidden_states=online")


# Reading ----------------------------------------------------------------------------------------

class Shard:
    """One shard file of a cache, memory-mapped when a row is first read from it, after its checksum is checked."""

    def __init__(self, folder: Path, record: dict):
        self.folder, self.path, self.record, self.rows = folder, folder / record["file"], record, record["rows"]
        self.file = None

    def check(self, checksum: bool) -> None:
        problem = shard_problem(self.path, self.record, checksum)
        if problem:
            raise UserError(f"data.cache_dir={self.folder}: shard {self.record['file']} is {problem}; {REBUILD} "
                            "(it recomputes only missing and damaged shards)")

    def opened(self):
        if self.file is None:
            self.check(checksum=True)
            self.file = safe_open(str(self.path), "pt")
        return self.file


class HiddenCache:
    """A built cache; rows are read from the memory-mapped shards as batches ask for them. Every shard's size is
    checked here, its checksum when a row is first read from it (a pass over its bytes)."""

    def __init__(self, folder: Path, index: dict):
        self.shards = {split: [Shard(folder, record) for record in records] for split, records in index["shards"].items()}
        for shard in (shard for shards in self.shards.values() for shard in shards):
            shard.check(checksum=False)

    def row(self, split: str, i: int) -> dict[str, torch.Tensor]:
        """{"aux_hidden": [len(layer_ids), T, H], "last_hidden": [T, H]} in float32 and "greedy" [T] (int64; not in
        caches built before it was stored), of row i of `split`."""
        for shard in self.shards[split]:
            if i < shard.rows:
                break
            i -= shard.rows
        shard = shard.opened()
        stored = {name: shard.get_slice(name)[i : i + 1] for name in shard.keys()}
        greedy = stored.pop("greedy", None)
        hidden = decode(stored)[0]
        return {"aux_hidden": hidden[:-1], "last_hidden": hidden[-1]} | ({} if greedy is None else {"greedy": greedy[0].long()})


def open_cache(recipe, target: FrozenTarget, data: TextDataModule) -> HiddenCache:
    """The cache at data.cache_dir, if it was built from this run's target, data and settings."""
    folder = Path(recipe.data.cache_dir)
    index = read_index(folder)
    expected = identity(recipe, target, data)
    for key in CHECKED:
        if index[key] != expected[key]:
            built, wanted = (f"{index[key]} ({index['target']})", f"{expected[key]} ({expected['target']})") \
                if key == "target_fingerprint" else (index[key], expected[key])
            raise UserError(f"data.cache_dir={folder} was built for {key} {built}, this run has {key} {wanted}; "
                            "rebuild it with `python -m train.hidden_cache` and this run's config")
    return HiddenCache(folder, index)


def check_cache(cfg) -> None:
    """The cache at data.cache_dir (DataConfig `cfg`) is there and whole: its index readable and every shard its
    recorded size. Cheap (no shard is read), so training checks it before the target loads; open_cache then
    checks what the cache was built from, and each shard's checksum at its first read."""
    folder = Path(cfg.cache_dir)
    HiddenCache(folder, read_index(folder))


def read_index(folder: Path) -> dict:
    """index.json of the cache at `folder`, refused in one line when missing, unreadable or from before checksums."""
    if not (folder / "index.json").is_file():
        raise UserError(f"data.cache_dir={folder} holds no hidden-state cache (no index.json); build it with "
                        "`python -m train.hidden_cache` and this run's config")
    index = read_record(folder / "index.json")
    if index is None:
        raise UserError(f"data.cache_dir={folder}: index.json is not a cache index (damaged?); {REBUILD}")
    records = [shard for shards in index["shards"].values() for shard in shards]
    if any(key not in index for key in CHECKED) or not all(isinstance(s, dict) and CHECKSUM in s for s in records):
        raise UserError(f"data.cache_dir={folder} was built before caches recorded their shards' checksums and the "
                        f"target's layers; {REBUILD}")
    return index


@hydra.main(config_path=str(PROJECT_ROOT / "conf"), config_name="config", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:

    if cfg.get("recipe") != "drafter":
        raise UserError(f"recipe={cfg.get('recipe')}: hidden-state caches are for drafter recipes (conf=eagle3, ...)")
    recipe = to_dataclass(DrafterRecipe, cfg)
    if recipe.data.hidden_states != "cache":
        raise UserError("python -m train.hidden_cache writes data.cache_dir: pass data.hidden_states=cache "
                        "data.cache_dir=<dir>, as training from it will")
    if recipe.trainer.num_threads:
        torch.set_num_threads(recipe.trainer.num_threads)
    accelerator = recipe.trainer.accelerator
    gpu = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    build(recipe, "cuda" if gpu else "cpu")


if __name__ == "__main__":
    run_cli(main)
