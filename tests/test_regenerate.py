"""train.regenerate: a chat dataset's replies replaced by the target's own generations, turn by
turn, in the messages layout that training reads."""

import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import make_model
from test_chat_data import chat_tokenizer, sharegpt_rows, write_jsonl  # noqa: F401 (a fixture)
from test_config import CONF, composed
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import UserError, to_dataclass
from engines.vllm_venv import worker_devices
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
                                                      "part-00002.jsonl.gz"]  # the last one closed when the run ended
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
    # Stopped between compressing a full shard and removing its plain copy: the copy is not read twice.
    (out / "part-00000.jsonl").write_bytes(gzip.decompress((out / "part-00000.jsonl.gz").read_bytes()))
    assert read(regenerate(config(chat_target_dir, chats, out, "limit=20", "shard_size=8"))) == whole
    with pytest.raises(UserError, match="other settings \\(max_new_tokens\\)"):
        regenerate(config(chat_target_dir, chats, out, "limit=20", "shard_size=8", "max_new_tokens=3"))


# ---------------------------------------------------------------- engine=vllm, without vLLM

FAKE_VLLM = '''"""A stand-in for vLLM in the project's venv: each reply is the prompt's last tokens (at most max_tokens), and a
sampled one starts with its seed, so tests can tell replies and seeds apart."""
import os
import time
from pathlib import Path


class SamplingParams:
    def __init__(self, temperature, max_tokens, seed=None, **rest):
        self.temperature, self.max_tokens, self.seed = temperature, max_tokens, seed


class Output:
    def __init__(self, token_ids):
        self.token_ids, self.finish_reason = token_ids, "length"


class Request:
    def __init__(self, token_ids):
        self.outputs = [Output(token_ids)]


class LLM:
    def __init__(self, **args):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise ValueError("cannot load the model\\nsecond line")
        if os.environ.get("FAKE_VLLM_PIDS"):
            Path(os.environ["FAKE_VLLM_PIDS"], str(os.getpid())).write_text(args["model"])

    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))
        return [Request((([p.seed] if p.temperature else []) + prompt["prompt_token_ids"][-p.max_tokens :])[: p.max_tokens])
                for prompt, p in zip(prompts, params)]
'''


@pytest.fixture(scope="module")
def fake_vllm_python(tmp_path_factory):
    """An executable standing for a vLLM venv's python: ours, with the stand-in vllm package on its path."""
    folder = tmp_path_factory.mktemp("fake_vllm")
    (folder / "vllm").mkdir()
    (folder / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (folder / "vllm-0.0.1.dist-info").mkdir()
    (folder / "vllm-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={folder} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def echoed_reply(tokenizer, messages: list[dict], seed: int | None = None) -> str:
    """What the stand-in answers to the conversation before a reply."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    new = ([seed] if seed is not None else []) + ids[-MAX_NEW:]
    return tokenizer.decode(new[:MAX_NEW], skip_special_tokens=True)


def test_vllm_engine_sends_each_rendered_prompt_to_its_worker(chat_target_dir, chats, tmp_path, fake_vllm_python):
    out = regenerate(config(chat_target_dir, chats, tmp_path / "regen", "engine=vllm", f"vllm_python={fake_vllm_python}"))
    tokenizer = AutoTokenizer.from_pretrained(chat_target_dir)
    regenerated = read(out)
    assert len(regenerated) == CONVERSATIONS
    for row in regenerated:
        messages = row["messages"]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":  # the second reply follows the engine's first
                assert m["content"] == echoed_reply(tokenizer, messages[:i])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["engine"].startswith("vLLM 0.0.1 (vllm) LLM.generate, torch ")
    assert meta["totals"]["replies"] == sum(1 + (k % 2 == 0) for k in range(CONVERSATIONS))
    assert meta["totals"]["cut"] == meta["totals"]["replies"]  # the stand-in never stops at EOS


def test_vllm_engine_samples_with_each_replys_seed(chat_target_dir, chats, tmp_path, fake_vllm_python):
    out = regenerate(config(chat_target_dir, chats, tmp_path / "regen", "engine=vllm", f"vllm_python={fake_vllm_python}",
                            "temperature=0.7", "seed=5", "limit=3", "max_replies=1"))
    tokenizer = AutoTokenizer.from_pretrained(chat_target_dir)
    for i, row in enumerate(read(out)):
        turn = next(t for t, m in enumerate(row["messages"]) if m["role"] == "assistant")
        assert row["messages"][turn]["content"] == echoed_reply(tokenizer, row["messages"][:turn], seed=5 + 1000 * i)


def test_vllm_engine_resumes_where_it_stopped(chat_target_dir, chats, tmp_path, fake_vllm_python):
    engine = ["engine=vllm", f"vllm_python={fake_vllm_python}", "shard_size=8"]
    whole = read(regenerate(config(chat_target_dir, chats, tmp_path / "whole", "limit=20", *engine)))
    out = tmp_path / "part"
    regenerate(config(chat_target_dir, chats, out, "limit=12", *engine))
    with (out / "part-00001.jsonl").open("a") as f:
        f.write('{"id": "cut mid-li')
    assert read(regenerate(config(chat_target_dir, chats, out, "limit=20", *engine))) == whole
    with pytest.raises(UserError, match="other settings \\(engine\\)"):
        regenerate(config(chat_target_dir, chats, out, "limit=20", "shard_size=8"))


def test_vllm_worker_failure_is_one_line(chat_target_dir, chats, tmp_path, fake_vllm_python, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(UserError, match=r"vLLM worker failed: ValueError: cannot load the model \(log: .*\.log\)$") as e:
        regenerate(config(chat_target_dir, chats, tmp_path / "regen", "engine=vllm", f"vllm_python={fake_vllm_python}"))
    log = Path(str(e.value).rsplit("(log: ", 1)[1].rstrip(")"))
    assert "Traceback" in log.read_text()  # kept for the user: the whole story
    log.unlink()


def test_missing_vllm_venv_is_one_line_saying_how_to_make_it(chat_target_dir, chats, tmp_path):
    args = [f"target.name_or_path={chat_target_dir}", f"data.path={chats}", "data.layout=sharegpt",
            f"out={tmp_path / 'regen'}", "engine=vllm", f"vllm_python={tmp_path / 'none' / 'python'}"]
    run = subprocess.run([sys.executable, "-m", "train.regenerate", *args], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith(f"error: no vLLM venv at {tmp_path / 'none' / 'python'}: make it with `python3.11 -m venv")


def test_sigterm_then_restart_loses_and_repeats_nothing(chat_target_dir, chats, tmp_path, fake_vllm_python):
    """The real command stopped by SIGTERM after its first shard: its vLLM worker ends with it, and the restart
    continues to the uninterrupted run's output."""
    engine = ["engine=vllm", f"vllm_python={fake_vllm_python}", "shard_size=4", "batch_size=1", "limit=24",
              "max_replies=1"]
    whole = read(regenerate(config(chat_target_dir, chats, tmp_path / "whole", *engine)))
    out, pids = tmp_path / "part", tmp_path / "pids"
    pids.mkdir()
    args = [sys.executable, "-m", "train.regenerate", f"target.name_or_path={chat_target_dir}", f"data.path={chats}",
            "data.layout=sharegpt", f"out={out}", f"max_new_tokens={MAX_NEW}", *engine,
            f"hydra.run.dir={tmp_path / 'hydra'}"]
    env = os.environ | {"FAKE_VLLM_DELAY": "0.1", "FAKE_VLLM_PIDS": str(pids)}
    logs = set(Path(tempfile.gettempdir()).glob("vllm-worker-*.log"))
    run = subprocess.Popen(args, env=env, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (out / "part-00000.jsonl.gz").exists() and run.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=30)
    for log in set(Path(tempfile.gettempdir()).glob("vllm-worker-*.log")) - logs:
        log.unlink()  # a killed run's worker log stays for its user; not this test's
    stopped_at = len(read(out))
    assert 4 <= stopped_at < 24
    time.sleep(0.5)
    worker = int(next(pids.iterdir()).name)
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text()
    assert read(regenerate(config(chat_target_dir, chats, out, *engine))) == whole


def test_worker_devices_one_gpu_each(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert worker_devices(None, "vllm_workers") == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert worker_devices(1, "vllm_workers") == [{"CUDA_VISIBLE_DEVICES": "2"}]
    with pytest.raises(UserError, match="vllm_workers=3 is not valid: must be at most the 2 visible GPUs"):
        worker_devices(3, "vllm_workers")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert worker_devices(None, "vllm_workers") == [{}]  # no GPU: one worker on the CPU


def test_a_closed_shard_is_never_appended_to(tmp_path):
    """A run that ends (or resumes) closes its last shard, full or not; the next appends start a new one, and the
    folder is counted by its shards' lines."""
    from train.regenerate import Shards

    shards = Shards(tmp_path, size=3)
    shards.append(["a", "b"])
    shards.close()
    closed = (tmp_path / "part-00000.jsonl.gz").read_bytes()
    assert shards.count() == 2 and not (tmp_path / "part-00000.jsonl").exists()
    shards.append(["c", "d", "e", "f"])
    assert (tmp_path / "part-00000.jsonl.gz").read_bytes() == closed
    assert sorted(p.name for p in tmp_path.glob("part-*")) == ["part-00000.jsonl.gz", "part-00001.jsonl.gz",
                                                               "part-00002.jsonl"]
    assert shards.count() == 6
