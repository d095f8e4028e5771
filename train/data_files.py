"""Local data files: a .json (array or JSON Lines), .jsonl, .parquet file, any of them gzipped but parquet, or a
folder of shards; each row told apart by where it is, so a problem is named by its line or item."""

import gzip
import json
from pathlib import Path
from typing import Callable

import datasets
import pyarrow
import pyarrow.parquet
from datasets.exceptions import DatasetGenerationError

from common.config import UserError
from common.corpus import read_cut_array
from common.progress import announce
from inference.evalsets import utf8_text

LISTED_PROBLEMS = 5


def refuse(what: str, problems: list[str], kind: str) -> None:
    """One error listing the first few problems, so a user fixes them all in one pass."""
    if problems:
        more = f"; and {len(problems) - LISTED_PROBLEMS} more" if len(problems) > LISTED_PROBLEMS else ""
        raise UserError(f"{what}: {len(problems)} {kind}: {'; '.join(problems[:LISTED_PROBLEMS])}{more}")


def read_path(path: Path) -> tuple[list[dict] | datasets.Dataset, Callable[[int], str]]:
    """A file, or a folder of shards (*.jsonl, *.jsonl.gz, *.parquet; other files such as a meta.json are
    not data) read in name order as one."""
    if not path.is_dir():
        return read_file(path)
    shards = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith((".jsonl", ".jsonl.gz", ".parquet")))
    if not shards:
        raise UserError(f"data.path={path} is a folder without shards (*.jsonl, *.jsonl.gz, *.parquet)")
    rows, places = [], []
    for shard in shards:
        shard_rows, where = read_file(shard)
        rows += list(shard_rows)
        places += [(shard.name, where) for where in map(where, range(len(shard_rows)))]
    return rows, lambda i: f"{places[i][0]} {places[i][1]}"


def read_file(path: Path) -> tuple[list[dict] | datasets.Dataset, Callable[[int], str]]:
    """The rows of a local file, and where row i is in it (for error messages)."""
    if path.suffix == ".parquet":
        return read_parquet(path), lambda i: f"row {i + 1}"
    suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix  # gzip: as the name inside says
    if suffix not in (".json", ".jsonl"):
        raise UserError(f"data.path={path}: expected a .json, .jsonl (either may be gzipped: .jsonl.gz) or .parquet file")
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as e:
        raise UserError(f"data.path={path}: cannot decompress it ({e})") from None
    text = utf8_text(data, f"data.path={path}")
    if suffix == ".json" and not text.lstrip().startswith("{"):  # a JSON array (an object starts JSON Lines)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            rows = read_cut_array(path, text, e, announce)
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise UserError(f"data.path={path}: expected a JSON array of objects (or JSON Lines)")
        return rows, lambda i: f"item {i + 1}"
    return read_jsonl(path, text)


def read_parquet(path: Path) -> datasets.Dataset:
    """A parquet file's rows; a truncated or damaged one is refused by name (its footer first: datasets would log
    pyarrow's error before raising it)."""
    try:
        pyarrow.parquet.ParquetFile(path)
        return datasets.Dataset.from_parquet(str(path))
    except (pyarrow.ArrowException, DatasetGenerationError, OSError) as e:
        cause = e.__cause__ or e  # datasets wraps what pyarrow raised while reading the row groups
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(f"data.path={path}: not a readable parquet file ({reason}); truncated or damaged? copy or "
                        "export it again") from None


def read_jsonl(path: Path, text: str) -> tuple[list[dict], Callable[[int], str]]:
    rows, line_numbers, problems = [], [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {n}: {e.msg} at column {e.colno}")
            continue
        if not isinstance(row, dict):
            problems.append(f"line {n}: a JSON {type(row).__name__}, not an object")
            continue
        rows.append(row)
        line_numbers.append(n)
    refuse(f"data.path={path}", problems, "lines are not JSON objects")
    return rows, lambda i: f"line {line_numbers[i]}"
