"""Progress of long phases: a bar on a terminal, a line every half minute in a log (a bar's carriage returns
would pile up on one line of a file), and announcements printed once however many processes train."""

import os
import sys

from tqdm import tqdm

LOG_INTERVAL_S = 30


class _Lines:
    """A file for tqdm that writes each redraw as its own line on stderr."""

    def write(self, text: str) -> None:
        if line := text.replace("\r", "").strip():
            print(line, file=sys.stderr, flush=True)

    def flush(self) -> None:
        pass


def bar(**kwargs) -> tqdm:
    """tqdm(**kwargs) on a terminal; on a file, the same figures as lines every LOG_INTERVAL_S seconds."""
    if sys.stderr.isatty():
        return tqdm(**kwargs)
    return tqdm(file=_Lines(), mininterval=LOG_INTERVAL_S, ascii=True, **kwargs)


def process_zero() -> bool:
    """Before the Trainer exists: torchrun and Lightning's launcher name every other process in the environment."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))


def announce(line: str) -> None:
    """A line the user reads once, from the first process."""
    if process_zero():
        print(line, flush=True)
