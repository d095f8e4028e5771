"""Tokenized splits are read back from the cache only when nothing they depend on changed; a damaged file is
said and rebuilt."""

import copy

import torch
from test_chat_data import CHATML

from train import data, token_cache
from train.chat_encoding import chat_template
from train.data import DataConfig, Tally

ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(6)]


def tokenized(tokenizer, examples, seq_len: int, calls: list):
    cfg = DataConfig(source="file", path=".", layout="messages", seq_len=seq_len)
    settings = {"layout": cfg.layout, "seq_len": seq_len, "template": chat_template(cfg, tokenizer)}

    def tokenize():
        calls.append(seq_len)
        return data.tokenize_split(examples, tokenizer, cfg)
    return token_cache.cached(examples, tokenizer, settings, tokenize, data)


def test_the_second_run_reads_the_rows_back_and_a_change_tokenizes_again(tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path))
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHATML
    calls = []
    first = tokenized(tokenizer, ROWS, 64, calls)
    again = tokenized(tokenizer, ROWS, 64, calls)
    assert calls == [64] and torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert Tally(**again[2]) == Tally(**first[2])
    tokenized(tokenizer, ROWS, 96, calls)  # another seq_len
    tokenized(tokenizer, ROWS[:5], 64, calls)  # other examples
    assert calls == [64, 96, 64]
    for path in tmp_path.glob("tokenized/*.pt"):
        path.write_bytes(b"damaged")
    assert torch.equal(tokenized(tokenizer, ROWS, 64, calls)[0], first[0]) and calls[-1] == 64
    assert "unreadable" in capsys.readouterr().out
