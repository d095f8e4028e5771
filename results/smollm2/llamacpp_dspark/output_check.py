"""Does llama.cpp's draft-dspark output equal llama.cpp's own speculative-simple decoding without drafts
(ngram-simple, which drafted nothing on these prompts)? And what does --spec-draft-p-min 0.1 draft? Same MT-bench
first turns as benchmarks.llamacpp_bench, greedy, one thread.
    PYTHONPATH=. python results/smollm2/llamacpp_dspark/output_check.py EXPORT DRAFT.gguf K MAX_NEW_TOKENS PROMPTS"""
import json
import sys
from pathlib import Path

from benchmarks.llamacpp_bench import after_prompt
from engines import llamacpp
from inference import evalsets, report
from inference.evalsets import EvalConfig
from speculators import export, gguf_file
from speculators.quant import QuantConfig

export_dir, draft, k, n, prompts_n = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
record = export.training_record(Path(export_dir)) or {}
drafter, target = report.load_pair(export_dir, quant=QuantConfig(**record.get("quant", {})))
source = gguf_file.locate(target.name_or_path)
rows = []
for p in evalsets.prompts(EvalConfig("mtbench", num_prompts=prompts_n, turns=1), target, n):
    text = target.tokenizer.decode(p.ids)
    plain = llamacpp.speculative_simple(source, None, text, n, draft_max=3, spec_type="ngram-simple")
    spark = llamacpp.speculative_simple(source, draft, text, n, draft_max=k, spec_type="draft-dspark", p_min=0.0)
    low = llamacpp.speculative_simple(source, draft, text, n, draft_max=k, spec_type="draft-dspark", p_min=0.1)
    a, b = after_prompt(plain.text, text).rstrip(), after_prompt(spark.text, text).rstrip()
    c = after_prompt(low.text, text).rstrip()
    rows.append({"ngram_drafted": plain.n_drafted, "dspark_drafted": spark.n_drafted, "dspark_accepted": spark.n_accept,
                 "same": a.startswith(b) or b.startswith(a),
                 "p01": [low.n_drafts, low.n_drafted, low.n_accept], "p01_same": a.startswith(c) or c.startswith(a)})
    print(rows[-1], flush=True)
print(json.dumps({"all_same": all(r["same"] for r in rows), "rows": rows}))
