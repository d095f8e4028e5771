"""GPU memory and time of training an EAGLE-3 drafter for a target, planned before renting the GPU:

    python -m benchmarks.memory_plan target=llama3_8b [batch_size=4 seq_len=2048 draft_vocab_size=32768 ...]

The target and its drafter (speculators/eagle3.py) are built on the meta device from the target's config alone:
no weight is read. `target` is a conf/target name, a Hugging Face config folder, a .gguf file (its header) or a
hub id; the configs of Llama-3.1-8B, Qwen3-8B and Llama-3.3-70B (the architecture of 3.1-70B) ship as data in
conf/benchmarks/hub_configs/, so those plan offline.

One training step holds (trainer=gpu: DDP in bf16-mixed, where Lightning keeps the parameters in fp32):
- persistently: the target's weights (its dtype, or as quant= packs them), the drafter's fp32 weights with its
  fp32 copy of the target's embeddings, AdamW's two fp32 moments, DDP's gradient buckets (fp32);
- at its peak, the largest of
  - the target's forward (no grad): the hidden states of every layer (output_hidden_states), the logits in the
    target's dtype and their fp32 copy, the fp32 features;
  - the end of the drafter's forward: the target's fp32 logits [tokens, V] (online; from a hidden-state cache,
    which stores the argmax, only the draft columns are computed) and features (held until the loss
    returns), their draft-vocabulary columns [tokens, N] in fp32, the activations autograd saved over the
    `depth` training-time-test steps, each step's keys and values, autocast's bf16 copies of the weights;
  - backward: those saved activations and weight copies, the fp32 gradients, the last step's logit gradients.

Saved activations, in bytes per token of TTT step j, read off Eagle3Drafter.training_loss (bf16-mixed under
CUDA's autocast rules | 32-true); H hidden, Q = heads x head_dim, I intermediate, N draft vocabulary:
  32 H               the norms' fp32 outputs, the hidden stream, q/k/v inputs (bf16: one cast per projection)
  (4 + 2j) Q x 2|4   attention: q, its output, and the keys and values of steps 0..j side by side
  4 I x 2|4          MLP: gate, up, silu(gate), their product
  8 H | 12 H and 6 N | 8 N on the positions the loss counts: the final norm and lm_head inputs, the draft
                     logits (bf16 | fp32) and the target's draft-vocabulary row (fp32) the loss keeps;
and once, the fused features fc reads: 6 H | 12 H. tests/test_memory_plan.py checks these counts against the
tensors autograd saves in a real drafter (32-true: exactly).

`measure=<recipe>` also trains that recipe here (benchmarks.device_check's loop: on the GPU if there is one,
else on the CPU, where the peak is the process's resident set) and prints measured beside planned figures.
"""

import copy
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from common.config import PROJECT_ROOT, UserError, at_least, one_of, require, run_command

GIB = 2**30
TARGETS = PROJECT_ROOT / "conf" / "target"
BUNDLED = PROJECT_ROOT / "conf" / "benchmarks" / "hub_configs"
ALIASES = {"meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.3-70B-Instruct"}  # one architecture
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# data.cache_dtype -> bytes of one hidden state of width H (float8 keeps an fp32 scale per token and layer)
CACHE_BYTES = {"bfloat16": lambda h: 2 * h, "float32": lambda h: 4 * h, "float8_e4m3": lambda h: h + 4}
GREEDY_BYTES = 4  # the target's argmax per token (int32) beside a cache's hidden states
QUANTS = ("none", "int8", "int4", "gguf")


@dataclass
class MemoryPlanConfig:
    """conf/benchmarks/memory_plan.yaml."""

    target: str = "???"
    dtype: str | None = None
    quant: str = "none"
    batch_size: int = 4
    seq_len: int = 2048
    draft_vocab_size: int = 32768
    depth: int = 5
    precision: str = "bf16-mixed"
    ddp: bool = True
    hidden_states: str = "online"
    cache_dtype: str = "bfloat16"
    loss_fraction: float = 1.0
    target_gpu_gib: float | None = None
    gpu_gib: float = 80.0
    reserve_gib: float = 2.0
    gpu_tflops: float = 989.0
    mfu: float = 0.3
    measure: str | None = None
    steps: int = 2
    out: str | None = None

    def __post_init__(self):
        if self.dtype is not None:
            one_of("dtype", self.dtype, DTYPE_BYTES)
        one_of("quant", self.quant, QUANTS)
        one_of("precision", self.precision, ("bf16-mixed", "32-true"))
        one_of("hidden_states", self.hidden_states, ("online", "cache"))
        one_of("cache_dtype", self.cache_dtype, CACHE_BYTES)
        at_least(1, batch_size=self.batch_size, depth=self.depth, draft_vocab_size=self.draft_vocab_size,
                 steps=self.steps)
        at_least(8, seq_len=self.seq_len)
        require(0 < self.loss_fraction <= 1, "loss_fraction", self.loss_fraction, "in (0, 1]")
        require(0 < self.mfu <= 1, "mfu", self.mfu, "in (0, 1]")
        require(self.target_gpu_gib is None or self.target_gpu_gib > 0, "target_gpu_gib", self.target_gpu_gib, "> 0")


# --- the target and its drafter, from configs -----------------------------------------------------------


@dataclass
class Target:
    name: str
    config: object  # a transformers PretrainedConfig
    dtype: str
    layer_ids: list[int]
    gpu_share_gib: float | None = None  # device_map + max_memory: what accelerate keeps on GPU 0, the rest offloaded


def resolve_target(name: str, dtype: str | None) -> Target:
    """A conf/target file (its model, dtype and layer ids), or a folder, .gguf file or hub id."""
    from speculators.target import default_layer_ids

    spec = OmegaConf.load(TARGETS / f"{name}.yaml") if (TARGETS / f"{name}.yaml").is_file() else None
    source = (spec.gguf_file or spec.name_or_path) if spec else name
    if source is None:
        raise UserError(f"conf/target/{name}.yaml names no model: pass target=<HF config folder or hub id>")
    config = load_config(source)
    layer_ids = list(spec.layer_ids) if spec and spec.layer_ids else default_layer_ids(config.num_hidden_layers)
    share = (spec.max_memory or {}).get(0) if spec and spec.device_map else None
    return Target(source, config, dtype or (spec.dtype if spec else "bfloat16"), layer_ids,
                  gib(str(share)) if share else None)


def gib(size: str) -> float:
    """accelerate's max_memory sizes: "70GiB" or "75GB"."""
    number, unit = re.fullmatch(r"([\d.]+)\s*(GiB|GB)", size).groups()
    return float(number) * (1 if unit == "GiB" else 1e9 / GIB)


def load_config(source: str):
    """The transformers config of a .gguf file (its header), a bundled hub config, a folder or a hub id."""
    from transformers import AutoConfig

    if source.endswith(".gguf"):
        from speculators import gguf_file

        path = gguf_file.locate(source)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    bundled = BUNDLED / (ALIASES.get(source, source).replace("/", "--") + ".json")
    if not Path(source).is_dir() and bundled.is_file():
        fields = {k: v for k, v in json.loads(bundled.read_text()).items() if not k.startswith("_")}
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        shipped = ", ".join(sorted(p.stem.replace("--", "/") for p in BUNDLED.glob("*.json")))
        raise UserError(f"target={source}: no config ({str(e).strip().splitlines()[0]}); offline, pass a conf/target "
                        f"name, a folder holding config.json, a .gguf file, or one of {shipped}") from None


def target_on_meta(target: Target, layers: bool = True):
    """The target's module tree with meta tensors; layers=False: embeddings, final norm and lm_head only."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = config.num_hidden_layers if layers else 0
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, target.dtype))


def drafter_on_meta(target: Target, depth: int, draft_vocab_size: int):
    """The Eagle3Drafter Eagle3Drafter.from_target builds for this target, with meta tensors; a draft vocabulary
    larger than the target's is all of it, as training makes it (train/distill.py fit_draft_vocab)."""
    from speculators.eagle3 import Eagle3Config, Eagle3Drafter
    from speculators.layers import layer_config

    vocab = target.config.vocab_size
    layer_cfg = layer_config(SimpleNamespace(config=target.config, vocab_size=vocab))
    cfg = Eagle3Config(depth=depth, draft_vocab_size=min(draft_vocab_size, vocab),
                       intermediate_size=layer_cfg.intermediate_size)
    with torch.device("meta"):
        return Eagle3Drafter(cfg, layer_cfg, target.layer_ids, target.config.hidden_size)


def stored_bytes(name: str, weight: torch.Tensor, quant: str, dtype_bytes: int) -> float:
    """Bytes per weight as speculators/quant/__init__.py keeps it: int8 with an fp32 scale per row; int4 two to a byte
    with an fp32 scale and zero per 32 columns (gguf serves its Q4_1 layers so); gguf's Q8_0 embeddings as int8
    with an fp32 scale per 32 columns."""
    in_layers = ".layers." in name and weight.dim() == 2
    if quant == "int8" and in_layers:
        return 1 + 4 / weight.shape[1]
    if quant in ("int4", "gguf") and in_layers:
        return 0.5 + 8 / 32
    if quant == "gguf" and weight.dim() == 2:
        return 1 + 4 / 32
    return dtype_bytes


def target_weight_bytes(model, quant: str, dtype_bytes: int) -> int:
    """Tied weights (SmolLM2's embeddings and lm_head) count once."""
    return round(sum(p.numel() * stored_bytes(n, p, quant, dtype_bytes) for n, p in model.named_parameters()))


# --- the plan ----------------------------------------------------------------------------------------------


@dataclass
class Shapes:
    """What the figures read of the target and the drafter."""

    hidden: int
    vocab: int
    layers: int
    q_width: int  # heads x head_dim
    kv_width: int
    intermediate: int
    draft_vocab: int
    aux: int  # target layers the drafter reads
    target_weights: int  # bytes
    target_matmul_params: int  # decoder linears and lm_head: 2 FLOPs each per token
    trainable: int  # drafter parameters AdamW trains
    frozen: int  # its copy of the target's embeddings
    drafter_buffers: int  # bytes: d2t, t2d
    layer_matmul_params: int  # the drafter layer's linears, run once per TTT step


def shapes_of(cfg: MemoryPlanConfig, target: Target) -> Shapes:
    model = target_on_meta(target, layers=cfg.hidden_states == "online")
    drafter = drafter_on_meta(target, cfg.depth, cfg.draft_vocab_size)
    attn, c = drafter.layers[0].self_attn, target.config
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return Shapes(
        hidden=c.hidden_size, vocab=c.vocab_size, layers=c.num_hidden_layers, q_width=attn.q_proj.out_features,
        kv_width=attn.k_proj.out_features, intermediate=drafter.layers[0].mlp.gate_proj.out_features,
        draft_vocab=drafter.lm_head.out_features, aux=len(target.layer_ids),
        target_weights=target_weight_bytes(model, cfg.quant, DTYPE_BYTES[target.dtype]),
        target_matmul_params=sum(m.weight.numel() for m in linears),
        trainable=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        frozen=sum(p.numel() for p in drafter.parameters() if not p.requires_grad),
        drafter_buffers=sum(b.numel() * b.element_size() for b in drafter.buffers()),
        layer_matmul_params=sum(m.weight.numel() for m in drafter.layers.modules() if isinstance(m, torch.nn.Linear)))


def saved_activations(s: Shapes, tokens: int, seq_len: int, depth: int, loss_fraction: float, mixed: bool) -> float:
    """Bytes autograd keeps for backward over the TTT steps (the module doc's table)."""
    a = 2 if mixed else 4  # bytes of what the linears and attention return
    total = (6 if mixed else 12) * s.hidden * tokens  # fc's input, once
    for j in range(depth):
        counted = tokens * loss_fraction * max(seq_len - 2 - j, 0) / seq_len  # position t trains on token t+2+j
        total += tokens * (32 * s.hidden + (4 + 2 * j) * s.q_width * a + 4 * s.intermediate * a)
        total += counted * ((8 if mixed else 12) * s.hidden + (6 if mixed else 8) * s.draft_vocab)
        total += seq_len * (j + 1) * seq_len * (1 + a)  # the TTT attention mask, and the bias kernels make of it
    return total


def step_parts(cfg: MemoryPlanConfig, s: Shapes, dtype_bytes: int, batch_size: int) -> dict[str, float]:
    """Bytes of the three candidates for the step's peak (module doc), beyond the persistent state."""
    tokens, mixed, T = batch_size * cfg.seq_len, cfg.precision == "bf16-mixed", cfg.seq_len
    a = 2 if mixed else 4
    copy32 = 0 if dtype_bytes == 4 else 4  # .to(float32) of an fp32 tensor copies nothing
    features = (s.aux + 1) * tokens * s.hidden * 4  # TargetOutput's fp32 aux and last hidden states
    draft_columns = tokens * s.draft_vocab * 4
    if cfg.hidden_states == "online":
        logits = tokens * s.vocab * 4
        head = tokens * s.vocab * (dtype_bytes + copy32) + (features if copy32 else 0)  # logits in both dtypes, features
        layer = tokens * dtype_bytes * (max(3 * s.intermediate, 3 * s.q_width + 3 * s.kv_width) + s.hidden)
        target_forward = (s.layers + 1) * tokens * s.hidden * dtype_bytes + max(layer, head)  # + every hidden state
    else:  # the batch brings the cached states (decoded to fp32) and argmax; lm_head's draft rows make the columns
        logits, target_forward = 0, features + draft_columns
    saved = saved_activations(s, tokens, T, cfg.depth, cfg.loss_fraction, mixed)
    weight_copies = 2 * s.trainable if mixed else 0  # autocast's bf16 copies, kept for backward
    kv_lists = cfg.depth * tokens * s.q_width * (6 if mixed else 8)  # each step's rotated keys and values
    last_logits_grad = tokens * cfg.loss_fraction * s.draft_vocab * a
    return {"target forward (no grad)": target_forward,
            "drafter forward end": logits + features + draft_columns + saved + kv_lists + weight_copies,
            "drafter backward": saved + weight_copies + 4 * s.trainable + last_logits_grad}


def figures(cfg: MemoryPlanConfig, s: Shapes, dtype_bytes: int, batch_size: int, gpu_share_gib: float | None) -> dict:
    on_gpu = s.target_weights if gpu_share_gib is None else min(s.target_weights, gpu_share_gib * GIB)
    persistent = {"target weights" + (" on the GPU (the rest offloaded)" if on_gpu < s.target_weights else ""): on_gpu,
                  "drafter weights (fp32, with its embedding copy)": 4 * (s.trainable + s.frozen) + s.drafter_buffers,
                  "AdamW moments (fp32)": 8 * s.trainable,
                  "DDP gradient buckets (fp32)": 4 * s.trainable if cfg.ddp else 0}
    step = step_parts(cfg, s, dtype_bytes, batch_size)
    peak_part = max(step, key=step.get)
    total = sum(persistent.values()) + step[peak_part]
    return {"batch_size": batch_size, "persistent_bytes": persistent, "offloaded_bytes": s.target_weights - on_gpu,
            "step_bytes": step, "step_peak_at": peak_part, "total_bytes": total,
            "fits": total <= (cfg.gpu_gib - cfg.reserve_gib) * GIB}


def largest_batch(cfg: MemoryPlanConfig, s: Shapes, dtype_bytes: int, gpu_share_gib: float | None,
                  limit: int = 4096) -> int:
    """The largest per-GPU batch whose step fits the GPU (0: not even one row)."""
    batch = 0
    while batch < limit and figures(cfg, s, dtype_bytes, batch + 1, gpu_share_gib)["fits"]:
        batch += 1
    return batch


def step_flops(cfg: MemoryPlanConfig, s: Shapes) -> float:
    """FLOPs of one step: the target's forward (online) and the drafter's forward and backward (3x) per TTT
    step; matmuls 2 per weight per token, causal attention about 2 x positions x Q per token and layer."""
    tokens, T = cfg.batch_size * cfg.seq_len, cfg.seq_len
    if cfg.hidden_states == "online":
        target = tokens * (2 * s.target_matmul_params + 2 * s.layers * T * s.q_width)
    else:
        target = tokens * 2 * s.hidden * s.draft_vocab  # lm_head's draft rows over the cached final states
    drafter = 3 * tokens * 2 * s.aux * s.hidden * s.hidden  # fc, once
    for j in range(cfg.depth):
        drafter += 3 * tokens * (2 * s.layer_matmul_params + 2 * s.hidden * s.draft_vocab * cfg.loss_fraction
                                 + 2 * (T / 2 + j) * s.q_width * 2)
    return target + drafter


def plan(cfg: MemoryPlanConfig, target: Target | None = None) -> dict:
    target = target or resolve_target(cfg.target, cfg.dtype)
    s = shapes_of(cfg, target)
    dtype_bytes = DTYPE_BYTES[target.dtype]
    share = cfg.target_gpu_gib or target.gpu_share_gib
    flops = step_flops(cfg, s)
    step_s = flops / (cfg.gpu_tflops * 1e12 * cfg.mfu)
    tokens = cfg.batch_size * cfg.seq_len
    return {"target": target.name, "target_dtype": target.dtype, "layer_ids": target.layer_ids,
            "config": asdict(cfg), "shapes": asdict(s),
            "target_weight_bytes": s.target_weights, **figures(cfg, s, dtype_bytes, cfg.batch_size, share),
            "largest_batch": largest_batch(cfg, s, dtype_bytes, share),
            "hidden_cache_bytes_per_token": (s.aux + 1) * CACHE_BYTES[cfg.cache_dtype](s.hidden) + GREEDY_BYTES,
            "time": {"step_tflop": flops / 1e12, "step_s": step_s, "tokens_per_s": tokens / step_s,
                     "gpu_hours_per_billion_tokens": 1e9 / (tokens / step_s) / 3600}}


# --- output ------------------------------------------------------------------------------------------------


def table(p: dict) -> str:
    cfg = p["config"]
    lines = [f"target {p['target']} ({p['target_dtype']}, quant={cfg['quant']}, layers {p['layer_ids']}), "
             f"batch {cfg['batch_size']} x {cfg['seq_len']}, draft vocabulary {cfg['draft_vocab_size']}, depth "
             f"{cfg['depth']}, {cfg['precision']}, hidden states {cfg['hidden_states']}, loss on "
             f"{cfg['loss_fraction']:.0%} of positions",
             f"drafter: {p['shapes']['trainable'] / 1e6:.1f}M trained parameters (+{p['shapes']['frozen'] / 1e6:.1f}M "
             "frozen embeddings)", f"{'':<50}{'GiB':>8}"]
    lines += [f"{name:<50}{value / GIB:>8.2f}" for name, value in p["persistent_bytes"].items() if value]
    lines += [f"{'step: ' + name + (' <- peak' if name == p['step_peak_at'] else ''):<50}{value / GIB:>8.2f}"
              for name, value in p["step_bytes"].items()]
    fits = "fits" if p["fits"] else "does not fit"
    lines += [f"{'total at the peak':<50}{p['total_bytes'] / GIB:>8.2f}",
              f"{cfg['gpu_gib']:g} GiB GPU ({cfg['reserve_gib']:g} GiB kept free): {fits}; the largest batch that fits: "
              f"{p['largest_batch']} x {cfg['seq_len']}",
              f"hidden-state cache: {p['hidden_cache_bytes_per_token']:,} bytes per token ({cfg['cache_dtype']}), "
              f"{p['hidden_cache_bytes_per_token'] * 1e6 / GIB:.1f} GiB per million tokens",
              f"time: {p['time']['step_tflop']:.1f} TFLOP a step, {p['time']['step_s']:.2f} s at {cfg['gpu_tflops']:g} "
              f"TFLOP/s x MFU {cfg['mfu']:g} (assumed): {p['time']['tokens_per_s']:,.0f} tokens/s, "
              f"{p['time']['gpu_hours_per_billion_tokens']:.1f} GPU-hours per billion tokens"
              + (f" (not counting the {p['offloaded_bytes'] / GIB:.0f} GiB of offloaded weights each step moves)"
                 if p["offloaded_bytes"] else "")]
    return "\n".join(lines)


# --- measured beside planned -------------------------------------------------------------------------------


def measure(cfg: MemoryPlanConfig, target: Target) -> dict:
    """Train conf=<cfg.measure> with this plan's settings for cfg.steps steps here; its figures and the plan's."""
    from benchmarks.device_check import compose_recipe, train_steps

    if not (TARGETS / f"{cfg.target}.yaml").is_file():
        raise UserError(f"measure= trains a recipe: target={cfg.target} must name a conf/target file")
    overrides = [f"target={cfg.target}", f"target.dtype={target.dtype}", f"quant={cfg.quant}",
                 f"data.batch_size={cfg.batch_size}", f"data.seq_len={cfg.seq_len}",
                 f"drafter.draft_vocab_size={cfg.draft_vocab_size}", f"drafter.depth={cfg.depth}",
                 f"trainer.precision={cfg.precision}", "data.max_examples=400"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    measured = train_steps(compose_recipe(cfg.measure, overrides), device, cfg.steps, warmup_steps=1)
    # The plan for the rows measured: the loss counted on the largest share of positions a batch had.
    planned = plan(replace_fields(cfg, loss_fraction=measured["trained_fraction_max"], ddp=False), target)
    step = planned["step_bytes"][planned["step_peak_at"]] + planned["persistent_bytes"]["AdamW moments (fp32)"]
    return {"measured": measured, "plan": planned, "comparison": {
        "target weights": (measured["target_weight_bytes"] / GIB, planned["target_weight_bytes"] / GIB),
        "training step above the loaded state": (measured["memory"]["peak_above_resident_gib"], step / GIB)}}


def replace_fields(cfg: MemoryPlanConfig, **changes) -> MemoryPlanConfig:
    return MemoryPlanConfig(**{**asdict(cfg), **changes})


def comparison_lines(result: dict) -> str:
    m = result["measured"]
    lines = [f"measured: conf={result['plan']['config']['measure']} on {m['device']}, {m['steps_timed']} steps "
             f"({m['tokens_per_s']:.0f} tokens/s), loss on at most {m['trained_fraction_max']:.0%} of a batch's positions; "
             "the plan for the same settings without DDP:", f"{'':<40}{'measured GiB':>14}{'planned GiB':>13}{'gap':>8}"]
    for name, (got, planned) in result["comparison"].items():
        lines.append(f"{name:<40}{got:>14.3f}{planned:>13.3f}{planned / got - 1:>+8.0%}")
    return "\n".join(lines)


def main(cfg: MemoryPlanConfig) -> None:
    target = resolve_target(cfg.target, cfg.dtype)
    result = plan(cfg, target)
    print(table(result))
    if cfg.measure:
        result["measured"] = measure(cfg, target)
        print(comparison_lines(result["measured"]))
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"written: {cfg.out}")


if __name__ == "__main__":
    run_command("memory_plan", MemoryPlanConfig, main, config_dir="conf/benchmarks")
