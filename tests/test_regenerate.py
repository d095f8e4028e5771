"""train.regenerate: a chat dataset's replies replaced by the target's own generations, turn by
turn, in the messages layout that training reads."""

import json

import pytest
from conftest import make_model
from test_chat_data import chat_tokenizer, sharegpt_rows, write_jsonl  # noqa: F401 (a fixture)
from test_config import CONF, composed
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculators.config import UserError, to_dataclass
from train.data import DataConfig, TextDataModule, load_examples, read_examples
from train.regenerate import RegenerateConfig, regenerate

MAX_NEW = 6
CONVERSATIONS = 40  # every second one has two replies; every third a system turn


@pytest.fixture(scope="module")
def chat_target_dir(chat_tokenizer, tmp_path_factory):  # noqa: F811
    """A tiny random Llama whose tokenizer carries a ChatML template."""
    path = tmp_path_factory.mktemp("chat_llama")
    make_model("llama", chat_tokenizer).save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", sharegpt_rows(CONVERSATIONS))


def config(target_dir, data, out, *overrides) -> RegenerateConfig:
    return to_dataclass(RegenerateConfig, composed([
        f"target.name_or_path={target_dir}", f"data.path={data}", "data.layout=sharegpt", f"out={out}",
        f"max_new_tokens={MAX_NEW}", "batch_size=4", *overrides], CONF, "regenerate"))


def greedy_replies(model, tokenizer, messages: list[dict]) -> list[str]:
    """The conversation's replies as the target writes them one at a time, unbatched."""
    messages, replies = [dict(m) for m in messages], []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        new = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        m["content"] = tokenizer.decode(new[0, ids.shape[1] :], skip_special_tokens=True)
        replies.append(m["content"])
    return replies


def read(folder) -> list[dict]:
    """The conversations of an output folder, shard after shard (as training reads it)."""
    return list(read_examples(DataConfig(source="file", path=str(folder), layout="messages")))


def test_replies_become_the_targets_greedy_generations_and_train(chat_target_dir, chats, tmp_path, capsys):
    out = regenerate(config(chat_target_dir, chats, tmp_path / "regen", "shard_size=16"))
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "part-00000.jsonl.gz", "part-00001.jsonl.gz",
                                                      "part-00002.jsonl"]
    assert "cut at max_new_tokens" in capsys.readouterr().out.splitlines()[-1]
    original, regenerated = [json.loads(line) for line in chats.read_text().splitlines()], read(out)
    model = AutoModelForCausalLM.from_pretrained(chat_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(chat_target_dir)
    assert [row["id"] for row in regenerated] == [row["id"] for row in original]  # every conversation, in order
    for before, after in zip(original, regenerated):
        roles = {"human": "user", "gpt": "assistant", "system": "system"}
        turns = [{"role": roles[t["from"]], "content": t["value"]} for t in before["conversations"]]
        assert [m["role"] for m in after["messages"]] == [t["role"] for t in turns]
        assert [m for m in after["messages"] if m["role"] != "assistant"] == [t for t in turns
                                                                              if t["role"] != "assistant"]
        replies = [m["content"] for m in after["messages"] if m["role"] == "assistant"]
        assert replies == greedy_replies(model, tokenizer, turns)  # the second reply follows the target's first
        assert replies != [t["content"] for t in turns if t["role"] == "assistant"]

    # `data=messages data.path=<out>` trains on it: the loss covers the regenerated replies.
    cfg = DataConfig(source="file", path=str(out), layout="messages", seq_len=256, batch_size=2, max_val_sequences=2)
    data = TextDataModule(cfg, load_examples(cfg), tokenizer, seed=0)
    data.setup("fit")
    assert data.train_mask.any() and data.train_rows.shape[1] == 256


def test_sampling_follows_the_seed(chat_target_dir, chats, tmp_path):
    runs = [read(regenerate(config(chat_target_dir, chats, tmp_path / name, *extra)))
            for name, extra in (("a", ["temperature=1.0"]), ("b", ["temperature=1.0"]), ("greedy", []))]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_settings_are_one_line_errors(chat_target_dir, chats, tmp_path):
    with pytest.raises(UserError, match="out=.*a folder"):
        config(chat_target_dir, chats, tmp_path / "regen.jsonl")
    with pytest.raises(UserError, match="data.layout='text' is not valid: must be sharegpt or messages"):
        config(chat_target_dir, chats, tmp_path / "r", "data.layout=text")
    with pytest.raises(UserError, match="temperature"):
        config(chat_target_dir, chats, tmp_path / "r", "temperature=-1")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is a folder of other files"):
        regenerate(config(chat_target_dir, chats, tmp_path / "taken"))
    with pytest.raises(UserError, match="engine='llamacpp' is not valid: must be transformers unless target.gguf_file"):
        config(chat_target_dir, chats, tmp_path / "r", "engine=llamacpp")


def test_an_interrupted_run_resumes_where_it_stopped(chat_target_dir, chats, tmp_path):
    """A run that stopped (a cut last line included) continues with the same settings; limit may grow."""
    whole = read(regenerate(config(chat_target_dir, chats, tmp_path / "whole", "limit=20", "shard_size=8")))
    out = tmp_path / "part"
    regenerate(config(chat_target_dir, chats, out, "limit=12", "shard_size=8"))
    with (out / "part-00001.jsonl").open("a") as f:
        f.write('{"id": "cut mid-li')  # what a kill during a write leaves
    assert read(regenerate(config(chat_target_dir, chats, out, "limit=20", "shard_size=8"))) == whole
    assert json.loads((out / "meta.json").read_text())["conversations"] == 20
    with pytest.raises(UserError, match="other settings \\(max_new_tokens\\)"):
        regenerate(config(chat_target_dir, chats, out, "limit=20", "shard_size=8", "max_new_tokens=3"))
