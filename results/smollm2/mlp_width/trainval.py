"""A drafter's step accuracies on N rows it trained on (a fixed draw from the training rows of the first
8,192 conversations, which stages 14 and 15 read twice) against N validation rows: does it still memorise?
python results/smollm2/mlp_width/trainval.py N [EXPORT ...] (default: models/smollm2-eagle3)"""
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from common.config import to_dataclass
from speculators import export
from speculators.target import FrozenTarget
from train.data import TextDataModule, load_examples
from train.recipes import DrafterRecipe

torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 32
drafters = sys.argv[2:] or ["models/smollm2-eagle3"]
with initialize_config_dir(str(Path(__file__).resolve().parents[3] / "conf"), version_base="1.3"):
    cfg = compose("config", ["conf=eagle3_smollm2", "data.max_examples=8192", "logger=none"])
recipe = to_dataclass(DrafterRecipe, cfg)
target = FrozenTarget.load(recipe.target, recipe.quant)
dm = TextDataModule(recipe.data, load_examples(recipe.data), target.tokenizer, 0)
dm.setup("fit")
g = torch.Generator().manual_seed(0)
idx = torch.randperm(len(dm.train_rows), generator=g)[:N]
sets = {"train": (dm.train_rows[idx], dm.train_mask[idx]), "val": (dm.val_rows[:N], dm.val_mask[:N])}
outs = {}
with torch.no_grad():
    for name, (rows, mask) in sets.items():
        outs[name] = [(target(rows[i:i + 4]), rows[i:i + 4], mask[i:i + 4]) for i in range(0, len(rows), 4)]
for path in drafters:
    drafter, _ = export.load(Path(path))
    export.share_target_embedding(drafter, target)
    drafter.eval()
    for name, batches in outs.items():
        sums = {}
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for tout, ids, m in batches:
                _, metrics = drafter.training_loss(tout, ids, m)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0) + float(v) / len(batches)
        print(path, name, {k: round(v, 3) for k, v in sorted(sums.items())}, flush=True)
