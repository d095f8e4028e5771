"""Runs inside NVIDIA ModelOpt 0.47's venv (benchmarks/peers/modelopt_peer.py makes it); never imports this
project. Trains ModelOpt's EAGLE-3 on the CPU and exports it with ModelOpt's own exporter:

    python modelopt_worker.py SPEC.json

SPEC: {"target": HF folder, "rows": rows.json (train/data.py's rows), "d2t": d2t.pt, "out": folder,
"steps", "batch_size", "seq_len", "lr", "betas", "warmup", "ttt", "decay", "layers" (ModelOpt's numbering:
the output of layer i), "draft_vocab", "seed", "dtype"}.

ModelOpt's recipe as in its examples/speculative_decoding: `mtsp.convert(model, [("eagle", config)])` on the HF
target (online: the frozen target runs inside every step), eagle3_default_config with the target's widths;
its forward computes the TTT loss. The loop is a plain AdamW loop (its example uses HF Trainer) so the schedule
is ours. On a CPU it needs eagle_use_torch_compile=False (torch.compile of the draft and loss otherwise) and
sdpa attention (its flex-attention TTT masks are for CUDA); nothing is patched.
"""

import copy
import json
import math
import random
import sys
import time
from pathlib import Path

import torch


def batches(rows: list, batch_size: int, seq_len: int, pad: int, seed: int):
    """Endless shuffled batches of `batch_size` rows, right-padded to `seq_len`."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            ids = torch.full((batch_size, seq_len), pad, dtype=torch.long)
            mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
            for j, i in enumerate(order[start:start + batch_size]):
                row_ids, row_mask = rows[i]
                ids[j, :len(row_ids)] = torch.tensor(row_ids)
                mask[j, :len(row_mask)] = torch.tensor(row_mask)
                attention[j, :len(row_ids)] = 1
            yield ids, attention, mask


def main(spec_file: str) -> None:
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import eagle3_default_config
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_file).read_text())
    torch.manual_seed(spec["seed"])
    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=dtype)
    t = model.config
    theta = getattr(t, "rope_theta", None) or (getattr(t, "rope_parameters", None) or {})["rope_theta"]
    arch = copy.deepcopy(eagle3_default_config) | {
        "num_hidden_layers": 1, "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "head_dim": t.hidden_size // t.num_attention_heads,
        "rms_norm_eps": t.rms_norm_eps, "rope_theta": theta, "rope_scaling": {"rope_type": "default", "rope_theta": theta},
        "draft_vocab_size": spec["draft_vocab"], "eagle_aux_hidden_state_layer_ids": spec["layers"],
        "torch_dtype": spec["dtype"], "_attn_implementation": "sdpa"}
    config = {"eagle_decoder_type": "llama", "eagle_offline": False, "eagle_freeze_base_model": True,
              "eagle_self_logit_distillation": True, "eagle_ttt_steps": spec["ttt"],
              "eagle_loss_decay_factor": spec["decay"], "eagle_use_torch_compile": False,
              "eagle_export_rope_scaling": {},  # its default writes YaRN x32 into the export: not the rope it trained
              "eagle_architecture_config": arch}
    mtsp.convert(model, [("eagle", config)])
    model.eagle_module.d2t.copy_(torch.load(spec["d2t"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"ModelOpt EAGLE-3: {sum(p.numel() for p in params):,} trained parameters, layers {spec['layers']} "
          f"(ModelOpt's numbering), TTT {spec['ttt']}", flush=True)
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=tuple(spec["betas"]), weight_decay=0.0)
    steps, warmup = spec["steps"], spec["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                              0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    rows = json.loads(Path(spec["rows"]).read_text())["train"]
    pad = t.pad_token_id if t.pad_token_id is not None else (t.eos_token_id or 0)
    data = batches(rows, spec["batch_size"], spec["seq_len"], pad, spec["seed"])
    times, tokens, start = [], [], time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        ids, attention, mask = next(data)
        out = model(input_ids=ids, attention_mask=attention, loss_mask=mask)
        out.loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        tokens.append(int(attention.sum()))
        acc = " ".join(f"{a:.3f}" for a in out.train_acc[0])
        print(f"global_step={step} loss={out.loss.item():.4f} acc=[{acc}] lr={sched.get_last_lr()[0]:.2e} "
              f"profile/step_ms={times[-1] * 1000:.0f}", flush=True)
    rest = times[1:] or times
    print(f"[train_cpu] {steps} steps; seconds/step: first {times[0]:.2f}, mean of the rest {sum(rest) / len(rest):.2f}; "
          f"tokens/step (packed, prompts included): {sum(tokens) / len(tokens):.0f}; process "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    model.eval()
    model.get_exporter().export(spec["out"])
    print(f"ModelOpt export: {spec['out']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
