#!/usr/bin/env bash
# Can the main command's run add something measurable by specialising the shipped drafter to one kind of its
# data? The regenerated conversations the shipped drafter never read (8,193-12,480) that hold code, 120 steps
# (four times the main command's 30) from models/smollm2-eagle3, the closing report on both turns of 8 held-out
# conversations of that slice, before and after. Usage: results/smollm2/main_command/code_slice/run.sh OUT
set -euo pipefail
out=${1:?usage: run.sh OUT}
mkdir -p "$out/codeslice"
python - "$out/codeslice" <<'PY'
import glob, gzip, json, re, shutil, sys
dest = sys.argv[1]
rows = [json.loads(line) for part in sorted(glob.glob("data/sharegpt-smollm2/part-*.jsonl.gz"))
        for line in gzip.open(part, "rt")]
code = re.compile(r"```|def |function |#include|public static|SELECT |import ")
kept = [r for r in rows[8192:] if any(code.search(m.get("content") or "") for m in r["messages"])]
with gzip.open(f"{dest}/part-00000.jsonl.gz", "wt") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
shutil.copy("data/sharegpt-smollm2/meta.json", dest)
print(f"{len(kept)} of {len(rows) - 8192} conversations hold code")
PY
python train.py conf=eagle3 data.path="$out/codeslice" data.skip_examples=0 trainer.max_steps=120 \
  trainer.val_every_n_steps=60 trainer.checkpoint_every_n_steps=60 eval.num_prompts=8 'serve_eval.ks=[2]' \
  hydra.run.dir="$out/run"
