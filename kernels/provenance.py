"""What every benchmark and report records beside its figures: the code's git revision and the machine.
It lives with the kernels, the lowest package, so the kernel benchmarks and the inference reports
(which import kernels, never the reverse) share one definition."""

import os
import platform
import re
import subprocess
from pathlib import Path

import torch


def git_revision() -> str | None:
    """HEAD, with -dirty when the work tree has changes; None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():  # an installed package: a git repository around site-packages is not ours
        return None
    try:
        def git(*cmd):
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = None
    return {"cpu": cpu.group(1) if cpu else platform.processor(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
