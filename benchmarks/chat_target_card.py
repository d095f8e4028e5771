"""Measure a chat target served from its GGUF file (target=smollm2) and write its card.

    python -m benchmarks.chat_target_card target=smollm2 out=models/smollm2

Every figure is measured in this run, nothing typed in:
- load times: the first load (the GGUF converted into an empty cache, speculators/gguf_file.py),
  a cached load, and a load with the file's own 4-bit weights packed (quant=gguf);
- held-out loss: assistant tokens of ShareGPT test-split conversations (split by id, train/data.py),
  for the dequantized fp32 target and the packed one as served (passes of 6 tokens, the CPU kernel's
  path), and their agreement on the same tokens (top-1 agreement, largest |logit difference|);
- greedy answers of the packed target to MT-bench questions;
- decode cost at a context of `context` tokens in the engine's StaticSession (inference/sessions.py):
  ms per pass of 1, 4, 8, 16 tokens, fp32 and packed interleaved, median of `repeats`;
- where a packed decode step's time goes: torch.profiler's operators, by self time.
Writes <out>/card.json and <out>/README.md.
"""

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from common import corpus
from common.config import at_least, run_command
from forge_kernels.provenance import git_revision, machine
from inference import evalsets
from inference.engine import generate
from inference.sessions import open_session
from speculators.quant import QuantConfig, weight_bytes
from speculators.target import FrozenTarget, TargetConfig
from train.chat_encoding import encode_chat
from train.data import conversation

VERIFY_WIDTH = 6  # tokens per pass when the card reads logits as served: a verification of K=5 drafts


@dataclass
class ChatTargetCardConfig:
    """conf/chat_target_card.yaml."""

    target: TargetConfig
    out: str  # the card's folder, e.g. models/smollm2
    packed: QuantConfig = field(default_factory=lambda: QuantConfig(scheme="gguf"))
    conversations: int = 40  # ShareGPT test conversations for the held-out loss
    seq_len: int = 1024  # each cut to this many tokens
    samples: int = 3  # MT-bench questions answered in the card
    sample_tokens: int = 128
    context: int = 256  # decode cost measured after this many tokens
    pass_tokens: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    repeats: int = 7
    profile_steps: int = 20

    def __post_init__(self):
        at_least(1, conversations=self.conversations, samples=self.samples, sample_tokens=self.sample_tokens,
                 repeats=self.repeats, profile_steps=self.profile_steps, context=self.context)
        at_least(16, seq_len=self.seq_len)


def load_times(cfg: ChatTargetCardConfig) -> tuple[dict, FrozenTarget, FrozenTarget]:
    """Seconds for a first load (conversion into an empty cache), a cached load and a packed load."""
    saved = os.environ.get("SPECULATORS_CACHE")
    with tempfile.TemporaryDirectory() as empty:
        os.environ["SPECULATORS_CACHE"] = empty
        started = time.perf_counter()
        FrozenTarget.load(cfg.target)
        first = time.perf_counter() - started
    if saved is None:
        del os.environ["SPECULATORS_CACHE"]
    else:
        os.environ["SPECULATORS_CACHE"] = saved
    FrozenTarget.load(cfg.target)  # converts into the real cache if it was empty
    started = time.perf_counter()
    full = FrozenTarget.load(cfg.target)
    cached = time.perf_counter() - started
    started = time.perf_counter()
    packed = FrozenTarget.load(cfg.target, cfg.packed)
    packed_s = time.perf_counter() - started
    times = {"first_load_s": first, "cached_load_s": cached, "packed_load_s": packed_s}
    return times, full, packed


@torch.no_grad()
def heldout(full: FrozenTarget, packed: FrozenTarget, cfg: ChatTargetCardConfig) -> dict:
    """Loss of both on the assistant tokens of test conversations, and how far the packed logits move."""
    tokenizer = full.tokenizer
    rows = corpus.sharegpt_split("test")
    nats = {"fp32": 0.0, "packed": 0.0}
    tokens = agree = conversations = 0
    max_diff = 0.0
    bar = tqdm(total=cfg.conversations, desc="held-out loss", unit="conversation")
    for row in rows:
        try:
            ids, mask = encode_chat(conversation(row, "sharegpt"), tokenizer, tokenizer.chat_template)
        except ValueError:
            continue
        ids, mask = ids[: cfg.seq_len], mask[: cfg.seq_len]
        scored = torch.tensor(mask[1:])  # position t predicts token t + 1
        if not scored.any():
            continue
        x = torch.tensor([ids])
        logits = {"fp32": full.model(x).logits[0, :-1], "packed": served_logits(packed, x)[:-1]}
        labels = x[0, 1:][scored]
        for name, values in logits.items():
            nats[name] += float(torch.nn.functional.cross_entropy(values[scored], labels, reduction="sum"))
        agree += int((logits["fp32"][scored].argmax(-1) == logits["packed"][scored].argmax(-1)).sum())
        max_diff = max(max_diff, float((logits["fp32"] - logits["packed"]).abs().max()))
        tokens += int(scored.sum())
        conversations += 1
        bar.update()
        if conversations == cfg.conversations:
            break
    bar.close()
    return {"conversations": conversations, "tokens": tokens, "seq_len": cfg.seq_len,
            "nats_per_token": {name: value / tokens for name, value in nats.items()},
            "top1_agreement": agree / tokens, "max_abs_logit_diff": max_diff}


def served_logits(target: FrozenTarget, ids: torch.Tensor, width: int = VERIFY_WIDTH) -> torch.Tensor:
    """Logits [T, V] as the engine computes them when serving: passes of `width` tokens through its
    session (the packed CPU kernel's path), not one pass over the whole sequence (dequantize + matmul)."""
    session = open_session(target, ids.shape[1] + 1)
    return torch.cat([session(ids[:, at : at + width]).logits[0] for at in range(0, ids.shape[1], width)])


def samples(target: FrozenTarget, cfg: ChatTargetCardConfig) -> list[dict]:
    questions = [turns[0] for turns in evalsets.EVAL_SETS["mtbench"].conversations(evalsets.EvalConfig(name="mtbench"))]
    picked = questions[:: max(1, len(questions) // cfg.samples)][: cfg.samples]
    answers = []
    for question in picked:
        ids = evalsets.render(target.tokenizer, [question], [], target.tokenizer.chat_template)
        out = generate(target, None, ids, cfg.sample_tokens, k=0).tokens
        answers.append({"question": question, "answer": target.tokenizer.decode(out, skip_special_tokens=True)})
    return answers


@torch.no_grad()
def decode_costs(targets: dict[str, FrozenTarget], cfg: ChatTargetCardConfig) -> dict:
    """Median ms of a target pass over m new tokens after `context` tokens, targets interleaved."""
    widest = max(cfg.pass_tokens)
    context = torch.randint(100, 10000, (1, cfg.context), generator=torch.Generator().manual_seed(0))
    sessions = {}
    for name, target in targets.items():
        session = open_session(target, cfg.context + widest)
        session(context)
        sessions[name] = session
    times = {name: {m: [] for m in cfg.pass_tokens} for name in targets}
    new = torch.randint(100, 10000, (1, widest), generator=torch.Generator().manual_seed(1))
    for repeat in range(cfg.repeats + 1):  # the first round warms up
        for m in cfg.pass_tokens:
            for name, session in sessions.items():
                session.crop(cfg.context)
                started = time.perf_counter()
                session(new[:, :m])
                if repeat:
                    times[name][m].append(1000 * (time.perf_counter() - started))
    return {name: {str(m): statistics.median(values) for m, values in by_m.items()} for name, by_m in times.items()}


@torch.no_grad()
def step_profile(target: FrozenTarget, cfg: ChatTargetCardConfig, top: int = 12) -> list[dict]:
    """Self CPU time per operator over `profile_steps` one-token decode steps, largest first."""
    session = open_session(target, cfg.context + cfg.profile_steps + 1)
    session(torch.randint(100, 10000, (1, cfg.context), generator=torch.Generator().manual_seed(0)))
    token = torch.tensor([[1000]])
    session(token)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(cfg.profile_steps):
            session(token)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "calls_per_step": e.count / cfg.profile_steps,
             "ms_per_step": e.self_cpu_time_total / 1000 / cfg.profile_steps,
             "share": e.self_cpu_time_total / total} for e in events[:top]]


def run(cfg: ChatTargetCardConfig) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    times, full, packed = load_times(cfg)
    card = {
        "target": cfg.target.name,
        "load": times,
        "weights_mb": {"fp32": weight_bytes(full.model) / 2**20, "packed": weight_bytes(packed.model) / 2**20},
        "heldout": heldout(full, packed, cfg),
        "samples": samples(packed, cfg),
        "decode_ms": decode_costs({"fp32": full, "packed": packed}, cfg),
        "step_profile_packed": step_profile(packed, cfg),
        "step_profile_fp32": step_profile(full, cfg),
        "config": asdict(replace(cfg, out=str(out))),
        "machine": machine(),
        "git_revision": git_revision(),
    }
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "README.md").write_text(render(card))
    print(f"card: {out / 'README.md'}")
    return out


def render(card: dict) -> str:
    h, load, ms = card["heldout"], card["load"], card["decode_ms"]
    passes = list(ms["fp32"])
    lines = [
        f"# {card['target']}: target card",
        "",
        "Measured by `python -m benchmarks.chat_target_card target=smollm2 out=models/smollm2` "
        f"({card['machine']['cpu']}, torch threads: {card['machine']['torch_threads']}, "
        f"torch {card['machine']['torch']}); every figure is in card.json.",
        "",
        "| what | fp32 (dequantized) | packed (quant=gguf) |",
        "|---|--:|--:|",
        f"| weights in memory | {card['weights_mb']['fp32']:.0f} MiB | {card['weights_mb']['packed']:.0f} MiB |",
        f"| load | {load['cached_load_s']:.1f} s cached, {load['first_load_s']:.1f} s first (GGUF conversion) | "
        f"{load['packed_load_s']:.1f} s |",
        f"| held-out ShareGPT loss ({h['conversations']} test conversations, {h['tokens']} assistant tokens) | "
        f"{h['nats_per_token']['fp32']:.3f} nats/token | {h['nats_per_token']['packed']:.3f} nats/token |",
        *[f"| decode pass of {m} token{'s' if m != '1' else ''} at context {card['config']['context']} | "
          f"{ms['fp32'][m]:.1f} ms | {ms['packed'][m]:.1f} ms |" for m in passes],
        "",
        f"Packed (as served: passes of {VERIFY_WIDTH} tokens) vs dequantized (one pass) on the same held-out tokens: "
        f"top-1 agreement {h['top1_agreement']:.4f}, "
        f"largest |logit difference| {h['max_abs_logit_diff']:.4f}.",
        "",
        "## Where a decode step's time goes (self time per operator, packed)",
        "",
        "| operator | calls per step | ms per step | share |",
        "|---|--:|--:|--:|",
        *[f"| `{p['op']}` | {p['calls_per_step']:.0f} | {p['ms_per_step']:.2f} | {p['share']:.0%} |"
          for p in card["step_profile_packed"]],
        "",
        "## Greedy answers to MT-bench questions (packed)",
        "",
    ]
    for sample in card["samples"]:
        lines += [f"**{sample['question']}**", "", "> " + sample["answer"].replace("\n", "\n> "), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    run_command("chat_target_card", ChatTargetCardConfig, run)
