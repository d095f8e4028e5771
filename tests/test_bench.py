"""The speed benchmark runs every method on the same prompts and checks each reproduces target-only greedy."""

from inference.bench import BenchConfig, run, table


def test_bench_runs_every_method_and_compares_outputs(llama_target, make_drafter, tokenizer):
    drafter = make_drafter(llama_target).eval()
    prompts = [tokenizer("import os\nimport sys\n")["input_ids"], tokenizer("def main():\n    return")["input_ids"]]
    cfg = BenchConfig(drafter="unused", max_new_tokens=12, num_speculative_tokens=3, repeats=2)
    rows = run(llama_target, drafter, llama_target.model, prompts, cfg)
    assert set(rows) == {"target_only", "speculative_chain", "speculative_tree", "hf_greedy", "hf_prompt_lookup",
                         "hf_assisted"}
    assert rows["target_only"]["speedup"] == 1.0
    for name, row in rows.items():
        assert len(row["seconds"]) == cfg.repeats and row["tokens_per_second"] > 0
        assert row["outputs_match_target_only"], name  # all greedy: all must equal target-only output
    assert "speculative_tree" in table(rows)
