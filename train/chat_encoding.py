"""A conversation rendered by the chat template, and its loss mask: the assistant turns as that template
renders them (train/data.py's docstring says how)."""

import re
from pathlib import Path

from common.config import UserError

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_template(cfg, tokenizer) -> str:
    """The Jinja template a train.data.DataConfig names (data.chat_template: a file or a template), else the
    tokenizer's own."""
    template = cfg.chat_template
    if template is not None and "{" not in template:  # a file; a Jinja template always has braces
        if not Path(template).is_file():
            raise UserError(f"data.chat_template={template!r} is neither a file nor a Jinja template")
        template = Path(template).read_text()
    try:
        return tokenizer.get_chat_template(template)
    except ValueError:
        raise UserError(f"data.layout={cfg.layout} needs a chat template and the target's tokenizer has none (a base "
                        "model?); set data.chat_template to a Jinja file or template") from None


def encode_chat(messages: list[dict], tokenizer, template: str) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the mask of its assistant tokens."""
    # Replies before any user turn answer nothing (and leave no prefix to diff against).
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return [], []
    if GENERATION_BLOCK.search(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return out["input_ids"], [bool(m) for m in out["assistant_masks"]]
    if not tokenizer.is_fast:
        raise UserError("the assistant-token mask needs a fast tokenizer (character offsets) or a chat template with "
                        "{% generation %} blocks (data.chat_template)")
    text, spans = assistant_spans(messages, tokenizer, template)
    trained = bytearray(len(text))
    for start, end in spans:
        trained[start:end] = b"\1" * (end - start)
    out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # the template wrote any BOS
    return out["input_ids"], [any(trained[start:end]) for start, end in out["offset_mapping"]]


def assistant_spans(messages: list[dict], tokenizer, template: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it."""
    def render(turns, generation_prompt=False):
        return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    text, spans = render(messages), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise UserError("the chat template renders earlier turns differently as a conversation grows (as templates "
                            "that drop past reasoning do), so assistant turns cannot be found by rendering prefixes; "
                            "set data.chat_template to one whose assistant turns are wrapped in {% generation %}...{% "
                            "endgeneration %}")
        spans.append((len(before), max(len(before), len(through.rstrip()))))
    return text, spans
