"""The default corpus: the source of the running Python's standard library.

Every machine has it offline. Files are split by a hash of their relative path, so the split
never depends on the machine, the order of the walk or a seed: test files are never trained
on, by the target's pretraining or by any drafter, and benchmarks prompt with them.
"""

import hashlib
import sysconfig
from pathlib import Path

import datasets

from speculators.config import UserError

SPLITS = ("train", "validation", "test")
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


def corpus_hash(files: datasets.DatasetDict) -> str:
    """A content hash of the corpus, so a model card says exactly what it was trained on."""
    h = hashlib.sha256()
    for split in SPLITS:
        for path, text in zip(files[split]["path"], files[split]["text"]):
            h.update(path.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]
