"""Replace a chat dataset's assistant replies with the target's own generations, so the drafter
learns what the target says rather than what another model said:

    python -m train.regenerate target.name_or_path=<chat model> data.path=chats.jsonl data.layout=sharegpt \
        out=regenerated.jsonl [temperature=0.7] [max_new_tokens=512]
    python train.py conf=eagle3 data=messages data.path=regenerated.jsonl ...

Every conversation is kept, in order, with its other fields; user and system turns are unchanged.
Each assistant turn that answers a user turn is generated from the conversation before it, as the
chat template renders it with a generation prompt, and with the target's own earlier replies. So
conversations are regenerated turn by turn: first every first reply (batched), then every second.
The output is JSON Lines in the messages layout that train/data.py reads. Examples are split by a
hash of their content, so a regenerated conversation may fall in another split than its original.
"""

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm
from transformers import GenerationConfig

from speculators.config import at_least, exit_on_user_error, require, run_cli, to_dataclass
from speculators.export import check_writable
from speculators.quant import QuantConfig
from speculators.target import FrozenTarget, TargetConfig
from train.data import CHAT_FIELDS, DataConfig, chat_template, conversation, read_examples


@dataclass
class RegenerateConfig:
    """conf/regenerate.yaml."""

    target: TargetConfig
    quant: QuantConfig
    data: DataConfig  # the conversations: source, path, split, layout and chat_template are read
    out: str  # a .jsonl file
    temperature: float = 0.0  # 0: greedy; else plain sampling at this temperature (no top-k or top-p)
    max_new_tokens: int = 256  # per reply; a reply cut here is counted in the summary
    batch_size: int = 8  # replies generated together (left-padded)
    seed: int = 0
    overwrite: bool = False

    def __post_init__(self):
        require(self.data.layout in CHAT_FIELDS, "data.layout", self.data.layout, "sharegpt or messages")
        require(self.out.endswith(".jsonl"), "out", self.out, "a .jsonl file (data.path of training reads it)")
        require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        at_least(1, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)


def regenerate(cfg: RegenerateConfig) -> Path:
    out = Path(cfg.out)
    check_writable(out, cfg.overwrite)
    target = FrozenTarget.load(replace(cfg.target, layer_ids=[]), cfg.quant)  # generation reads no features
    template = chat_template(cfg.data, target.tokenizer)
    rows = read_examples(cfg.data)
    conversations = [conversation(row, cfg.data.layout) for row in rows]
    # (turn index, conversation) of every reply to regenerate; turn i needs the replies before it, so by round.
    replies = [(i, c) for c, messages in enumerate(conversations) for i, m in enumerate(messages)
               if m["role"] == "assistant" and any(earlier["role"] == "user" for earlier in messages[:i])]
    torch.manual_seed(cfg.seed)
    cut = 0
    with tqdm(total=len(replies), unit="reply", desc="regenerating") as bar:
        for turn in sorted({i for i, _ in replies}):
            batch_of_round = [c for i, c in replies if i == turn]
            for start in range(0, len(batch_of_round), cfg.batch_size):
                chosen = batch_of_round[start : start + cfg.batch_size]
                prompts = [target.tokenizer.apply_chat_template(conversations[c][:turn], chat_template=template,
                                                                tokenize=False, add_generation_prompt=True)
                           for c in chosen]
                texts, n_cut = generate(target, prompts, cfg)
                for c, text in zip(chosen, texts):
                    conversations[c][turn]["content"] = text
                cut += n_cut
                bar.update(len(chosen))
    partial = out.with_name(out.name + ".partial")
    key = CHAT_FIELDS[cfg.data.layout][0]
    with partial.open("w", encoding="utf-8") as f:
        for row, messages in zip(rows, conversations):
            f.write(json.dumps({k: v for k, v in row.items() if k != key} | {"messages": messages}, default=str) + "\n")
    os.replace(partial, out)
    how = f"temperature {cfg.temperature}" if cfg.temperature else "greedy"
    print(f"regenerated {len(replies)} replies in {len(rows)} conversations ({how}; {cut} cut at max_new_tokens="
          f"{cfg.max_new_tokens}): {out}")
    return out


@torch.no_grad()
def generate(target: FrozenTarget, prompts: list[str], cfg: RegenerateConfig) -> tuple[list[str], int]:
    """The replies to rendered prompts, and how many of them max_new_tokens cut."""
    tokenizer = target.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The template wrote any BOS; left padding keeps each prompt's last token last.
    batch = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    eos = target.model.generation_config.eos_token_id or tokenizer.eos_token_id
    # Spelled out: transformers fills what is unset from the target's own defaults (do_sample, top-k, top-p, ...).
    sampling = dict(temperature=cfg.temperature, top_k=0, top_p=1.0) if cfg.temperature else {}
    config = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=bool(cfg.temperature), eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id, **sampling)
    new = target.model.generate(**batch.to(target.device), generation_config=config)
    new = new[:, batch["input_ids"].shape[1] :].cpu()
    ended = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos])).any(-1)
    return tokenizer.batch_decode(new, skip_special_tokens=True), int((~ended).sum())


@hydra.main(config_path="../conf", config_name="regenerate", version_base="1.3")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    regenerate(to_dataclass(RegenerateConfig, cfg))


if __name__ == "__main__":
    run_cli(main)
