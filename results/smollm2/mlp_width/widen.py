"""A function-preserving wider copy of an EAGLE-3 export: the MLP grows from F to F2 units, the new
units' down_proj columns zero (so the drafter computes what it did), their gate/up rows drawn like
the old ones. python widen.py SRC DST F2"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

src, dst, width = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.name not in ("model.safetensors", "config.json") and f.is_file():
        shutil.copy(f, dst / f.name)
w = load_file(src / "model.safetensors")
g = torch.Generator().manual_seed(0)
for name in ("gate_proj", "up_proj"):
    old = w[f"layers.0.mlp.{name}.weight"].float()
    new = torch.randn(width - old.shape[0], old.shape[1], generator=g) * old.std()
    w[f"layers.0.mlp.{name}.weight"] = torch.cat([old, new]).to(torch.bfloat16)
down = w["layers.0.mlp.down_proj.weight"]
w["layers.0.mlp.down_proj.weight"] = torch.cat([down, torch.zeros(down.shape[0], width - down.shape[1], dtype=down.dtype)], 1)
save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
config["transformer_layer_config"]["intermediate_size"] = width
(dst / "config.json").write_text(json.dumps(config, indent=2))
print(dst, {k: tuple(v.shape) for k, v in w.items() if "mlp" in k})
