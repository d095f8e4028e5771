"""A copy of an EAGLE-3 export with a larger draft vocabulary: the old N tokens keep their lm_head rows,
the next most frequent tokens of the target's regenerated answers (data/sharegpt-smollm2, assistant turns,
the first MAX_EXAMPLES conversations) are added, each with the target's own lm_head row scaled by the mean
norm ratio of the old rows (the drafter's lm_head started from the target's rows: speculators/eagle3.py).

    python results/smollm2/draft_vocab/grow.py SRC DST SIZE MAX_EXAMPLES
"""
import gzip
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from inference import report
from speculators import draft_vocab

src, dst, size, max_examples = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
drafter, target = report.load_pair(str(src))
tokenizer, vocab = target.tokenizer, len(drafter.t2d)
counts, seen = torch.zeros(vocab, dtype=torch.long), 0
for part in sorted(Path("data/sharegpt-smollm2").glob("part-*.jsonl*")):
    with (gzip.open(part, "rt") if part.suffix == ".gz" else open(part)) as lines:
        for line in lines:
            if seen == max_examples:
                break
            seen += 1
            for message in json.loads(line)["messages"]:
                if message["role"] == "assistant":
                    counts += torch.bincount(torch.tensor(tokenizer(message["content"])["input_ids"], dtype=torch.long),
                                             minlength=vocab)[:vocab]
old = drafter.t2d.clone()
counts[old] = counts.max() + 1  # the old vocabulary stays whole
d2t, t2d = draft_vocab.build(counts, size)
weights = load_file(src / "model.safetensors")
target_rows = target.model.get_output_embeddings().weight.detach().float()
old_ids = torch.nonzero(old).flatten()
ratio = (weights["lm_head.weight"].float().norm(dim=1) / target_rows[old_ids].norm(dim=1)).mean()
kept = torch.nonzero(t2d).flatten()
rows = target_rows[kept] * ratio
rows[old[kept]] = weights["lm_head.weight"].float()  # both sorted by target id
weights |= {"lm_head.weight": rows.to(torch.bfloat16), "d2t": d2t, "t2d": t2d}
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.is_file() and f.name not in ("model.safetensors", "config.json", "README.md", "card.json"):
        shutil.copy(f, dst / f.name)
save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
config["draft_vocab_size"] = size
(dst / "config.json").write_text(json.dumps(config, indent=2))
print(f"{dst}: {size} tokens ({old.sum().item()} kept), norm ratio {ratio:.3f}, {seen} conversations")
