"""Hidden states through vLLM's CPU build, the way speculators 0.9.0 asks a vLLM server for them
(scripts/launch_vllm.py + hs_connectors' "file" backend), but offline in one process (vllm.LLM):

    speculative_config = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                          "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}
    kv_transfer_config = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": OUT/raw}}

Each prompt is generated with max_tokens=1 (as speculators' generate_hidden_states does); the connector writes
OUT/raw/<req_id>.safetensors {hidden_states [T, len(LAYERS), H], token_ids [T]} and returns its path in
RequestOutput.kv_transfer_params["hidden_states_path"]. This script copies them to OUT/vllm_{i}.safetensors.

Run with vLLM's venv python (see FINDINGS.md for the exact command and environment)."""

import json
import os
import sys
import time
import traceback

for key, value in {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   # The engine core in its own process, as under `vllm serve`: in-process (0, the project runner's
                   # setting) nothing steps the engine after LLM.generate returns, so the connector never writes
                   # the last batch and load_hidden_states waits on its lock forever (seen: FINDINGS.md).
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():
    os.environ.setdefault(key, value)

MODEL = os.environ.get("TARGET", "/tmp/peer-speculators/smollm2-hf")
OUT = os.path.dirname(os.path.abspath(__file__))
LAYERS = [2, 15, 27, 30]  # the project's [2, 15, 27] + num_hidden_layers (launch_vllm.py --include-last-layer)
# ExampleHiddenStatesConnector: vLLM's own, as speculators' file backend names it; CPUHiddenStatesConnector: the
# subclass without its pinned-memory/CUDA-stream copy, first written here and now engines/vllm_hidden_connector.py.
CONNECTOR = sys.argv[1] if len(sys.argv) > 1 else "ExampleHiddenStatesConnector"
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "Explain what a hash table is in two sentences.", "Give me three tips for sleeping better.",
           "How many legs does a spider have?", "Translate 'good morning' into Spanish and German.",
           "What is 17 times 23?", "Name a famous painting by Leonardo da Vinci."]


def main() -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    raw = os.path.join(OUT, "raw")
    os.makedirs(raw, exist_ok=True)
    report = {"model": MODEL, "layers": LAYERS, "prompt_tokens": [len(p) for p in prompts]}
    try:
        import torch
        import vllm
        from safetensors.torch import load_file, save_file
        from vllm import LLM, SamplingParams

        report.update(vllm_version=vllm.__version__, torch_version=torch.__version__)
        args = dict(model=MODEL, tokenizer=MODEL, dtype="float32", max_model_len=2048, max_num_seqs=8, seed=0,
                    enforce_eager=True, enable_prefix_caching=False,
                    speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                        "draft_model_config": {"hf_config": {
                                            "eagle_aux_hidden_state_layer_ids": LAYERS}}},
                    kv_transfer_config={"kv_connector": CONNECTOR, "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"shared_storage_path": raw}})
        if CONNECTOR != "ExampleHiddenStatesConnector":  # ours, out of tree (a module in this folder)
            sys.path.insert(0, os.path.join(OUT, "..", "..", "..", "engines"))
            args["kv_transfer_config"]["kv_connector_module_path"] = "vllm_hidden_connector"
        report["engine_args"] = args
        t0 = time.perf_counter()
        llm = LLM(**args)
        report["load_seconds"] = time.perf_counter() - t0
        one = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
        for i, path in enumerate(paths):  # the connector writes in a thread; its .lock is held until done
            from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
            data = load_hidden_states(path)
            save_file({k: v.contiguous() for k, v in data.items()}, os.path.join(OUT, f"vllm_{i}.safetensors"))
        seconds = time.perf_counter() - t0
        tokens = sum(len(p) for p in prompts)
        report.update(seconds=seconds, tokens=tokens, tokens_per_second=tokens / seconds,
                      shapes=[list(load_file(os.path.join(OUT, f"vllm_{i}.safetensors"))["hidden_states"].shape)
                              for i in range(len(prompts))], error=None)
        code = 0
    except Exception as e:  # noqa: BLE001
        report.update(error=f"{type(e).__name__}: {e}".splitlines()[0], traceback=traceback.format_exc())
        code = 1
    report["connector"] = CONNECTOR
    with open(os.path.join(OUT, f"vllm_result_{CONNECTOR}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps({k: v for k, v in report.items() if k not in ("traceback", "engine_args")}, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
