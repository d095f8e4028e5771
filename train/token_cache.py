"""Tokenized splits kept on disk. Rendering ShareGPT's 15,852 conversations through a chat template takes
minutes on a CPU, at every run of the same data; the rows are read back instead when nothing they depend on
changed (the examples, the tokenizer, the chat template, seq_len and the code that renders them). A file that
cannot be read is said and rebuilt."""

import dataclasses
import hashlib
import inspect
import io
import json
from typing import Callable

import torch

from common.files import cache_root, write_atomically


def cached(examples, tokenizer, settings: dict, tokenize: Callable, rendering_code) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """tokenize() -> (rows, mask, tally) of `examples`, read from the cache where it holds them; the tally as a
    dict. `settings`: what else the rows depend on (layout, seq_len, the chat template's text)."""
    path = cache_root() / "tokenized" / f"{key(examples, tokenizer, settings, rendering_code)}.pt"
    if path.exists():
        try:
            saved = torch.load(path, weights_only=True)
            return saved["rows"].long(), saved["mask"], saved["tally"]
        except Exception as e:  # a damaged or foreign file: tokenize again, and say so
            print(f"tokenized cache {path} unreadable ({type(e).__name__}): tokenizing again", flush=True)
    rows, mask, tally = tokenize()
    tally = dataclasses.asdict(tally)
    buffer = io.BytesIO()
    torch.save({"rows": rows.to(torch.int32), "mask": mask, "tally": tally}, buffer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, buffer.getvalue())
    except OSError as e:  # a cache that cannot be written costs the next run time, not this run
        print(f"tokenized cache not written ({e.strerror or e}): the next run tokenizes again", flush=True)
    return rows, mask, tally


def key(examples, tokenizer, settings: dict, rendering_code) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode() if tokenizer.is_fast else repr(tokenizer).encode())
    digest.update(inspect.getsource(rendering_code).encode())
    fingerprint = getattr(examples, "_fingerprint", None)  # a datasets.Dataset knows its own content
    if fingerprint:
        digest.update(fingerprint.encode())
    else:
        for row in examples:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:24]
