"""What this project does on this machine's GPU, in one JSON file:

    python -m benchmarks.device_check [out=device_check.json] [steps=20]

1. the machine: GPUs (name, memory, compute capability), CUDA, driver, torch, Triton, transformers, git revision;
2. the GPU test tier, `python -m pytest -m gpu` in a child process (tests/test_gpu.py);
3. training, for each of `recipes` (the SmolLM2 EAGLE-3 drafter, and DSpark with the references' five block
   layers): warmup_steps + steps optimizer steps in this process, on the GPU, in the recipe's precision: trained
   tokens/s (median step) and peak memory;
4. serving: the shipped drafter (models/smollm2-eagle3) against target-only decoding on the GPU, on MT-bench
   first turns (inference.report.measure): tau, tokens/s, speed-up, outputs identical or not.

A failing section is recorded with its error and the others still run; the command then exits nonzero.
On a machine without a CUDA GPU it prints one line, "no GPU: ...", writes nothing and exits 1.

The training loop is DrafterModule's step without Lightning around it (the target outside autocast, the
drafter's loss under it, its outputs freed before backward, gradients clipped, AdamW), so the memory it
measures is the step's own. benchmarks.memory_plan runs the same loop (measure=<recipe>) to check its plan.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from common.config import PROJECT_ROOT, at_least, run_command

GIB = 2**30


@dataclass
class DeviceCheckConfig:
    """conf/benchmarks/device_check.yaml."""

    out: str = "device_check.json"
    steps: int = 20
    warmup_steps: int = 3
    recipes: dict[str, list[str]] = field(default_factory=lambda: {  # conf=<name> -> its overrides
        "eagle3_smollm2": ["data.max_examples=400"],
        "dspark_smollm2": ["data.max_examples=400", "drafter.num_layers=5"]})
    drafter: str = "models/smollm2-eagle3"
    quant: str = "gguf"
    num_prompts: int = 8
    max_new_tokens: int = 64
    gpu_tests: bool = True
    tests_timeout_s: int = 420

    def __post_init__(self):
        at_least(1, steps=self.steps, num_prompts=self.num_prompts, max_new_tokens=self.max_new_tokens,
                 tests_timeout_s=self.tests_timeout_s)
        at_least(0, warmup_steps=self.warmup_steps)


# --- memory of a device ------------------------------------------------------------------------------


class Memory:
    """Bytes in use and their peak since reset_peak(): the CUDA caching allocator's count on a GPU, the
    process's resident set on the CPU (Linux: VmRSS, and VmHWM, which writing 5 to clear_refs resets)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else proc_status_bytes("VmRSS")

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else proc_status_bytes("VmHWM")

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")


def proc_status_bytes(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- sections ------------------------------------------------------------------------------------------


def gpu_machine() -> dict:
    import transformers
    import triton

    from forge_kernels.provenance import git_revision, machine

    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return {"gpus": [{"name": p.name, "memory_gib": round(p.total_memory / GIB, 2),
                      "compute_capability": f"{p.major}.{p.minor}"} for p in gpus],
            "cuda": torch.version.cuda, "driver": nvidia_driver(), "triton": triton.__version__,
            "transformers": transformers.__version__, "bf16_supported": torch.cuda.is_bf16_supported(),
            "git_revision": git_revision(), **machine()}


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def run_gpu_tests(timeout_s: int) -> dict:
    """`python -m pytest -m gpu` over tests/, its summary line and, when it fails, its last lines."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # compiled kernels
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "tests"]
    started = time.perf_counter()
    child = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = child.stdout.strip().splitlines()
    result = {"ok": child.returncode == 0, "command": " ".join(command[1:]), "returncode": child.returncode,
              "summary": lines[-1] if lines else "", "seconds": round(time.perf_counter() - started, 1)}
    if child.returncode != 0:
        result["tail"] = lines[-40:] + child.stderr.strip().splitlines()[-10:]
    return result


def compose_recipe(name: str, overrides: list[str]):
    """The DrafterRecipe `python train.py conf=<name> <overrides>` runs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from common.config import check_resolvable, to_dataclass
    from train.recipes import DrafterRecipe

    GlobalHydra.instance().clear()  # this command's own config is composed already
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"conf={name}", *overrides])
    check_resolvable(cfg)
    return to_dataclass(DrafterRecipe, cfg)


def train_steps(recipe, device: torch.device, steps: int, warmup_steps: int) -> dict:
    """Train the recipe's drafter warmup_steps + steps optimizer steps on `device`; time the last `steps`."""
    from torch.utils.data import DataLoader

    from common.config import to_dataclass
    from speculators import draft_vocab
    from speculators.families import family
    from speculators.quant import weight_bytes
    from speculators.target import FrozenTarget
    from train.data import EndlessShuffle, TextDataModule, load_examples
    from train.distill import fit_draft_vocab
    from train.optim import configure

    memory = Memory(device)
    target = FrozenTarget.load(recipe.target, recipe.quant).to(device)
    data = TextDataModule(recipe.data, load_examples(recipe.data), target.tokenizer, recipe.seed)
    data.setup("fit")
    drafter_class = family(recipe.drafter.get("family"))
    drafter_cfg = fit_draft_vocab(to_dataclass(drafter_class.config_class, recipe.drafter, "drafter"), target)
    counts = draft_vocab.count_tokens(data.train_rows, data.train_mask, target.vocab_size)
    torch.manual_seed(recipe.seed)
    drafter = drafter_class.from_target(drafter_cfg, target, counts).to(device)
    schedule = configure(list(drafter.parameters()), recipe.optim, recipe.trainer.max_steps)
    optimizer, scheduler = schedule["optimizer"], schedule["lr_scheduler"]["scheduler"]
    batches = DataLoader(EndlessShuffle(data.train_rows, data.train_mask, recipe.seed), batch_size=recipe.data.batch_size)
    bf16 = recipe.trainer.resolved_precision().startswith("bf16")
    resident = memory.now()
    memory.reset_peak()
    seconds, losses, trained = [], [], []
    for _, batch in zip(range(warmup_steps + steps), batches):
        started = time.perf_counter()
        losses.append(train_step(drafter, target, optimizer, batch, device, bf16, recipe.trainer.gradient_clip_val))
        scheduler.step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        trained.append(float(batch["loss_mask"].float().mean()))
    step_s = statistics.median(seconds[warmup_steps:])
    tokens = recipe.data.batch_size * recipe.data.seq_len
    return {"recipe": {"target": recipe.target.name, "quant": recipe.quant.scheme, "target_dtype": recipe.target.dtype,
                       "batch_size": recipe.data.batch_size, "seq_len": recipe.data.seq_len,
                       "precision": recipe.trainer.resolved_precision(), "drafter": asdict(drafter_cfg)},
            "device": str(device), "steps_timed": steps, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "losses": losses, "trained_fraction_max": max(trained),
            "target_weight_bytes": weight_bytes(target.model), "memory": {
                "resident_before_steps_gib": resident / GIB, "peak_gib": memory.peak() / GIB,
                "peak_above_resident_gib": (memory.peak() - resident) / GIB}}


def train_step(drafter, target, optimizer, batch: dict, device: torch.device, bf16: bool, clip: float) -> float:
    """One optimizer step as DrafterModule and Lightning take it."""
    ids, mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)
    out = target(ids)  # the teacher as served: outside autocast, no gradients
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, _ = drafter.training_loss(out, ids, mask)
    del out  # Lightning's step lets the target's outputs go before backward
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def serve(cfg: DeviceCheckConfig, device: torch.device) -> dict:
    """The shipped drafter against target-only decoding on `device`, on MT-bench first turns."""
    from inference import evalsets, report
    from inference.evalsets import EvalConfig
    from speculators.quant import QuantConfig

    quant = QuantConfig(scheme=cfg.quant)
    drafter, target = report.load_pair(str(PROJECT_ROOT / cfg.drafter), None, quant)
    target.to(device)
    drafter.to(device)
    inference = report.InferenceConfig(drafter=cfg.drafter, quant=quant, max_new_tokens=cfg.max_new_tokens,
                                       eval=EvalConfig(name="mtbench", num_prompts=cfg.num_prompts, turns=1))
    result = report.measure(target, drafter, evalsets.prompts(inference.eval, target, cfg.max_new_tokens), inference)
    keys = ("acceptance_length", "acceptance_rate_per_position", "tokens_per_second", "baseline_tokens_per_second",
            "speedup", "outputs_match_baseline", "num_prompts", "peak_memory_mb")
    return {"drafter": cfg.drafter, "k": result["config"]["k"], **{key: result[key] for key in keys}}


# --- the command ----------------------------------------------------------------------------------------


def no_gpu_line() -> str:
    if torch.version.cuda is None:
        return (f"no GPU: torch {torch.__version__} is a CPU-only build (install the torch build for your CUDA); "
                "nothing was measured")
    return (f"no GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device (driver, "
            "CUDA_VISIBLE_DEVICES?); nothing was measured")


def section(name: str, run) -> dict:
    """run() as one section of the report; an error is recorded, not raised, so the other sections still run."""
    print(f"device check: {name} ...", flush=True)
    try:
        return {"ok": True, **run()}
    except Exception as error:  # a diagnostic: report what broke and go on
        first = (str(error).strip().splitlines() or [""])[0]
        print(f"device check: {name} failed: {type(error).__name__}: {first}", flush=True)
        return {"ok": False, "error": f"{type(error).__name__}: {first}"}


def check(cfg: DeviceCheckConfig) -> None:
    if not torch.cuda.is_available():
        sys.exit(no_gpu_line())
    device = torch.device("cuda")
    started = time.perf_counter()
    report = {"config": asdict(cfg), "machine": gpu_machine()}
    if cfg.gpu_tests:
        report["gpu_tests"] = section("GPU test tier", lambda: run_gpu_tests(cfg.tests_timeout_s))
    report["training"] = {name: section(f"training conf={name}", lambda: train_steps(
        compose_recipe(name, overrides), device, cfg.steps, cfg.warmup_steps)) for name, overrides in cfg.recipes.items()}
    report["serving"] = section(f"serving {cfg.drafter}", lambda: serve(cfg, device))
    report["seconds"] = round(time.perf_counter() - started, 1)
    Path(cfg.out).write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report, cfg.out))
    sections = [report.get("gpu_tests", {"ok": True}), *report["training"].values(), report["serving"]]
    if not all(s["ok"] for s in sections):
        sys.exit(1)


def summary(report: dict, out: str) -> str:
    gpu = report["machine"]["gpus"][0]
    lines = [f"{gpu['name']} ({gpu['memory_gib']} GiB), CUDA {report['machine']['cuda']}, torch {report['machine']['torch']}"]
    if "gpu_tests" in report:
        lines.append(f"GPU test tier: {report['gpu_tests'].get('summary') or report['gpu_tests'].get('error')}")
    for name, train in report["training"].items():
        lines.append(f"training {name}: {train['tokens_per_s']:.0f} tokens/s, {train['step_s'] * 1000:.0f} ms a step, "
                     f"peak {train['memory']['peak_gib']:.2f} GiB" if train["ok"] else
                     f"training {name} failed: {train['error']}")
    served = report["serving"]
    lines.append(f"serving: tau {served['acceptance_length']:.2f} at K={served['k']}, {served['tokens_per_second']:.1f} "
                 f"vs {served['baseline_tokens_per_second']:.1f} tokens/s target-only ({served['speedup']:.2f}x), outputs "
                 f"identical: {served['outputs_match_baseline']}" if served["ok"] else f"serving failed: {served['error']}")
    return "\n".join([*lines, f"written: {out} ({report['seconds']:.0f} s)"])


if __name__ == "__main__":
    run_command("device_check", DeviceCheckConfig, check, config_dir="conf/benchmarks")
