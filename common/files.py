"""Files written whole or not at all, and output locations checked before long work: the helpers every writer
of the project shares (exports, reports, caches)."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from common.config import UserError


def cache_root() -> Path:
    """What the project makes once per machine and reuses (converted GGUFs, tokenized data, step costs,
    llama.cpp's build, the peers' venvs): $SPECULATORS_CACHE, else ~/.cache/speculators-forge."""
    root = os.environ.get("SPECULATORS_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "speculators-forge"


def sync_file(path: Path) -> None:
    """Its bytes on the disk; of a folder, its entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a folder or a file, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def check_writable(out_dir: Path, overwrite: bool, hint: str = "overwrite=true") -> None:
    """An existing export is replaced only when asked: it may be the only copy of days of training. Its
    folder is checked writable before anything is computed."""
    if (out_dir.exists() or out_dir.is_symlink()) and not overwrite:
        raise UserError(f"{out_dir} already exists; pass {hint} to replace it")
    check_folder_writable(out_dir.parent)


def disk_error(path: Path, error: Exception) -> UserError:
    """One line for a write the disk refused (full, read-only, no permission), naming the path."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error).strip().splitlines()[0]
    return UserError(f"cannot write {path}: {reason}")


def check_folder_writable(folder: Path, key: str | None = None) -> None:
    """Refuse, before any long work, an output folder that cannot be created or written into; `key` is the
    setting that named it. Tried by writing there; the folders it created for that are removed again."""
    folder = Path(folder)
    missing = [path for path in (folder, *folder.parents) if not path.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise UserError(f"{f'{key}=' if key else ''}{folder}: cannot write there ({error.strerror or error})") from None
    finally:
        for path in missing:
            with contextlib.suppress(OSError):
                path.rmdir()


def write_atomically(path: Path, data: str | bytes) -> None:
    """`path` whole or not at all: a sibling temporary file, synced, then renamed over it. A refused write
    (a full disk) leaves the previous file as it was and nothing beside it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    data = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
        sync_file(path.parent)  # the folder's entries: the rename itself
    except OSError as error:
        remove(partial)
        raise disk_error(path, error) from None
    except BaseException:
        remove(partial)
        raise
