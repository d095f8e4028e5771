"""Compares the hidden states extract_vllm.py wrote (vllm_{i}.safetensors) with transformers' on the same token
ids: layer l in [2, 15, 27] against output_hidden_states[l] (the input of decoder layer l), layer 30 against the
last decoder layer's output before the final norm (a pre-hook on model.norm; HF's hidden_states[30] is after it).
Also times transformers' forward on the same prompts, one at a time, for scale. Run with vLLM's venv python."""

import glob
import json
import os
import time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
OUT = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get("TARGET", "/tmp/peer-speculators/smollm2-hf")
LAYERS = [2, 15, 27, 30]

model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
captured = {}
model.model.norm.register_forward_pre_hook(lambda mod, args: captured.__setitem__("pre_norm", args[0]))
files = sorted(glob.glob(os.path.join(OUT, "vllm_[0-9]*.safetensors")), key=lambda p: int(p.rsplit("_", 1)[1][:-12]))
per_layer = {l: 0.0 for l in LAYERS}
rel = {l: 0.0 for l in LAYERS}
tokens, seconds = 0, 0.0
with torch.inference_mode():
    for path in files:
        data = load_file(path)
        ids, hs = data["token_ids"].long(), data["hidden_states"].float()
        t0 = time.perf_counter()
        o = model.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        seconds += time.perf_counter() - t0
        tokens += len(ids)
        ref = [o.hidden_states[l][0] for l in LAYERS[:-1]] + [captured["pre_norm"][0]]
        for j, l in enumerate(LAYERS):
            diff = (hs[:, j] - ref[j]).abs().max().item()
            per_layer[l] = max(per_layer[l], diff)
            rel[l] = max(rel[l], diff / ref[j].abs().max().item())
result = {"files": len(files), "tokens": tokens, "max_abs_diff": per_layer, "max_abs_diff_over_max_abs": rel,
          "hf_forward_seconds": seconds, "hf_tokens_per_second": tokens / seconds}
json.dump(result, open(os.path.join(OUT, "compare_result.json"), "w"), indent=1)
print(json.dumps(result))
