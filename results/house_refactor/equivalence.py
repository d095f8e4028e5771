"""Does the house refactor (issue #58) change a number? Each family's training loss and metrics on one batch of
the pycode toy target, and the shipped drafter's serving logits, written to a JSON to compare between revisions.
Run from a checkout's root (it imports that checkout's code): PYTHONPATH=. python <this file> OUT.json"""

import json
import sys

import torch

from speculators import export
from speculators.families import family
from speculators.target import FrozenTarget, TargetConfig

torch.set_num_threads(1)

target = FrozenTarget.load(TargetConfig("models/pycode", layer_ids=[1, 4, 6]))
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, target.vocab_size, (2, 48), generator=g)
mask = torch.ones_like(ids)
counts = torch.bincount(ids.flatten(), minlength=target.vocab_size).float() + 1
out = {}
for name, extra in [("eagle3", {"draft_vocab_size": 256}), ("eagle", {}), ("peagle", {"draft_vocab_size": 256}),
                    ("medusa", {}), ("dflash", {"draft_vocab_size": 256})]:
    cls = family(name)
    torch.manual_seed(0)
    drafter = cls.from_target(cls.config_class(**extra), target, counts)
    drafter.eval()
    with torch.no_grad():
        loss, metrics = drafter.training_loss(target(ids), ids, mask)
    out[name] = {"loss": float(loss), **{k: float(v) for k, v in sorted(metrics.items())},
                 "weights": float(sum(p.double().sum() for p in drafter.state_dict().values() if p.is_floating_point()))}
drafter, _ = export.load("models/smollm2-eagle3")
cache = drafter.new_cache(1, 64)
tokens = torch.randint(0, 1000, (1, 8), generator=g)
hidden = torch.randn(1, 8, drafter.layer_cfg.hidden_size, generator=g)
with torch.no_grad():
    logits, h = drafter.step(cache, tokens, hidden)
    logits2, _ = drafter.step(cache, tokens[:, -1:], h[:, -1:])
out["shipped"] = {"logits_sum": float(logits.double().sum()), "argmax": logits[0].argmax(-1).tolist(),
                  "next_sum": float(logits2.double().sum())}
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out)[:300])
