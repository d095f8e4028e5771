"""Compiling a C++ extension with torch.utils.cpp_extension, safely beside other runs.

torch guards a build folder with a lock file it creates with O_EXCL and waits on while it exists; a
build killed (SIGKILL, a lost node) leaves that file, and every later load waits forever. Here every
build first takes an flock on `owner` in the folder, which the kernel releases when its holder dies,
whatever killed it: holding it, no other live run of ours is building there, so a torch lock found
then was left by a dead build and is cleared (one line says so). `owner` records the holder's pid and
host, for that line and for filesystems without flock, where a lock whose recorded owner is a process
of this host that no longer runs is cleared.

The folder is keyed by a hash of the sources, the flags and torch's version: two checkouts with
different kernel sources (or torch builds) each keep their own build instead of rebuilding each other's.
"""

import contextlib
import fcntl
import hashlib
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

# A killed build's compiler may outlive it (ninja and c++ are its children, not killed with it).
ORPHAN_WAIT_S = 600


def extensions_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))


def build_directory(name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> Path:
    """<TORCH_EXTENSIONS_DIR>/<name>-<hash of the sources' bytes, the flags and torch's version>."""
    digest = hashlib.sha256()
    for part in (torch.__version__, os.environ.get("CXX", ""), *cflags, "|", *ldflags, "|"):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(Path(source).read_bytes() + b"\0")
    return extensions_root() / f"{name}-{digest.hexdigest()[:16]}"


def load_library(name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], purpose: str) -> Path:
    """Build (once) and load the extension into torch.ops; the folder it lives in. `purpose` words the
    one line printed when it compiles."""
    build = build_directory(name, sources, cflags, ldflags)
    build.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    with build_lock(build):
        if not (build / f"{name}.so").exists():
            print(f"compiling {', '.join(Path(s).name for s in sources)} for {purpose} (once per machine) in {build}",
                  file=sys.stderr)
        load(name=name, sources=[str(s) for s in sources], build_directory=str(build), is_python_module=False,
             extra_cflags=list(cflags), extra_ldflags=list(ldflags))  # copies: torch appends to them
    return build


@contextlib.contextmanager
def build_lock(build: Path):
    """Hold the folder's flock for a build; clear the torch lock a dead build left there."""
    with open(build / "owner", "a+") as owner:
        locked = take_flock(owner)  # waits for a live build; a dead one's flock is already gone
        owner.seek(0)
        previous = owner.read().strip()
        if locked or owner_is_dead(previous):
            clear_stale_torch_lock(build, previous)
        owner.seek(0)
        owner.truncate()
        owner.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        owner.flush()
        try:
            yield
        finally:
            if locked:
                fcntl.flock(owner, fcntl.LOCK_UN)


def take_flock(file) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX)
        return True
    except OSError:  # a filesystem without locks (some NFS): the recorded owner's pid decides
        return False


def owner_is_dead(owner: str) -> bool:
    """Whether `pid N on HOST` names a process of this host that no longer runs."""
    words = owner.split()
    if len(words) != 4 or words[2] != "on" or words[3] != socket.gethostname() or not words[1].isdigit():
        return False
    try:
        os.kill(int(words[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def clear_stale_torch_lock(build: Path, previous_owner: str) -> None:
    lock = build / "lock"
    if not lock.exists():
        return
    wait_for_orphans(build)
    lock.unlink(missing_ok=True)
    print(f"cleared {lock}, left by a build that was killed ({previous_owner or 'owner unknown'}, no longer "
          f"running); rebuilding", file=sys.stderr)


def wait_for_orphans(build: Path, timeout_s: float = ORPHAN_WAIT_S) -> None:
    """Wait while a process still works in the folder (a dead build's ninja or compiler): two builds at
    once would write the same objects."""
    deadline = time.monotonic() + timeout_s
    while processes_in(build) and time.monotonic() < deadline:
        time.sleep(0.5)


def processes_in(folder: Path) -> list[int]:
    """Pids of processes whose working directory is `folder` (Linux /proc; elsewhere none are seen)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if os.path.samefile(entry / "cwd", folder):
                found.append(int(entry.name))
    return found
