"""Drafter exports in the formats serving engines load unchanged.

An export is a folder with config.json and model.safetensors (or, gguf, one file). Each format is one file of
speculators/formats/ (its layout described there) with a writer, `(drafter, verifier) -> (config, weights)`,
and a reader, `(config, weights) -> drafter`; `save` and `load` do what every format shares: validation, atomic
writes (a sibling temporary folder renamed into place, so an interrupted export leaves the previous one
intact), no silent overwrite, and refusing corrupt or truncated files. The formats: speculators (vLLM:
EAGLE-3, P-EAGLE, DFlash, DSpark), eagle (EAGLE-1), eagle3 (the original EAGLE-3 layout, SGLang), dflash (the
original DFlash layout), medusa, gguf (llama.cpp, written only) and trtllm (TensorRT-LLM); a format of your own
is a module on the Python path named on first use (docs/new_export_format.md).

Any export converts to another format that can hold the drafter:
    python -m speculators.export source=<export dir> out=<out> format=eagle3

An EAGLE-3 export in a format that shares the target's embeddings (speculators, eagle3, trtllm) may leave out
embed_tokens (shared_embedding=true): it is the target's own, frozen, and vLLM and SGLang share the target's when
a drafter has none; this project's loaders take it from the target (`share_target_embedding`). With
dtype=bfloat16 an export is stored at half the size. Both make a drafter small enough to ship
(models/smollm2-eagle3: 20 MB instead of 152 MB). A conversion keeps both: the source's dtype (unless dtype=)
and embeddings left out stay out. config.json records the stored dtype (torch_dtype, and `dtype` where a
Llama config has it). A write the disk refuses (full, read-only) ends in one line naming the path and leaves
nothing behind.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.config import UserError
from common.files import check_writable, disk_error, remove, sync_file, write_atomically
from speculators.formats import FORMATS, Format, Verifier, export_format, families_of, format_of
from speculators.layers import decoding_linears
from speculators.quant import QuantizedLinear, quantized_linears, serving_quant


def save(drafter, out_dir: Path, verifier: Verifier, overwrite: bool = False, training: dict | None = None,
         fmt: str | None = None, dtype: str | None = None, shared_embedding: bool = False) -> Path:
    """Write the export into a sibling temporary folder, then move it in place whole. `training`
    (steps, tokens seen, ...) goes to training.json beside the weights: serving engines ignore it.
    `fmt` defaults to the drafter's own format (`export_format`); `dtype` (e.g. bfloat16) stores the
    floating-point weights in it (None: as they are); `shared_embedding` leaves out an EAGLE-3 drafter's
    embed_tokens, as does a drafter loaded from an export that left it to the target."""
    if any(isinstance(m, QuantizedLinear) for m in drafter.modules()):
        raise UserError("this drafter's linear layers are quantized for serving (drafter_quant): export the drafter "
                        "as trained, or load it with drafter_quant=none")
    fmt = fmt or drafter.export_format
    spec = export_format(fmt)
    if fmt not in drafter.export_formats and drafter.family not in spec.families:
        raise UserError(f"the {fmt} format holds {', '.join(families_of(fmt))} drafters, not {drafter.family}")
    if spec.save is not None:
        return spec.save(drafter, out_dir, verifier, overwrite)
    config, weights = spec.write(drafter, verifier)  # validates before anything is written
    extra = weights.pop(spec.extra_file, None)
    weights = without_shared_embedding(drafter, spec, weights, shared_embedding)
    weights = stored_in(dtype, weights)
    record_dtype(config, floating_dtype(weights))
    out_dir = Path(out_dir)
    texts = spec.beside(drafter, out_dir) if spec.beside else {}
    check_writable(out_dir, overwrite)
    partial = out_dir.with_name(out_dir.name + ".partial")
    try:
        write_folder(partial, spec, config, weights, extra, training, texts)
        move_into_place(partial, out_dir)
    except (OSError, SafetensorError) as error:  # a full disk, a read-only folder
        raise disk_error(out_dir, error) from None
    finally:
        remove(partial)  # nothing half-written left beside the export
    return out_dir


def write_folder(folder: Path, fmt: Format, config: dict, weights: dict, extra, training: dict | None,
                 texts: dict[str, str]) -> None:
    remove(folder)
    folder.mkdir(parents=True)
    weights_file = folder / fmt.weights_file
    save_file({name: t.detach().cpu().contiguous() for name, t in weights.items()}, weights_file)
    weights_file.chmod(0o644)  # safetensors writes 0600; serving often runs as another user
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if extra is not None:
        torch.save(extra, folder / fmt.extra_file)
    if training is not None:
        (folder / "training.json").write_text(json.dumps(training, indent=2))
    for name, text in texts.items():
        (folder / name).write_text(text)
    sync(folder)


def sync(folder: Path) -> None:
    """Every file of the folder on disk before it is renamed into place (a full disk fails here, not later)."""
    for file in folder.iterdir():
        sync_file(file)


def without_shared_embedding(drafter, fmt: Format, weights: dict, shared_embedding: bool) -> dict:
    """The weights without embed_tokens where it is the target's: asked (shared_embedding), or never loaded
    (an export that left it to the target: what the drafter holds there is not the target's)."""
    sharing = fmt.name in sharing_formats()
    if shared_embedding and (drafter.cfg.family != "eagle3" or not sharing):
        raise UserError(f"shared_embedding: only EAGLE-3 drafters in the {', '.join(sharing_formats())} formats leave "
                        f"out their embeddings (a {drafter.cfg.family} drafter in the {fmt.name} format keeps its own)")
    left = "embed_tokens.weight" in getattr(drafter, "left_to_target", ())
    if left and "embed_tokens.weight" not in fmt.left_to_target and "embed_tokens.weight" in weights:
        raise UserError(f"the {fmt.name} format stores the drafter's embeddings, and this drafter's export left them "
                        f"to the target; export it in a format that shares the target's")
    if shared_embedding or left:
        return {name: t for name, t in weights.items() if name != "embed_tokens.weight"}
    return weights


def sharing_formats() -> list[str]:
    """The formats an EAGLE-3 drafter may leave its embeddings out of: the engines take the target's."""
    return [name for name, fmt in FORMATS.items() if "embed_tokens.weight" in fmt.left_to_target
            and "eagle3" in families_of(name)]


def stored_in(dtype: str | None, weights: dict) -> dict:
    """The weights with floating-point tensors in `dtype` (None: as they are)."""
    if dtype is None:
        return weights
    stored = getattr(torch, dtype, None)
    if not isinstance(stored, torch.dtype) or not stored.is_floating_point:
        raise UserError(f"dtype={dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16, float32)")
    return {name: t.to(stored) if t.is_floating_point() else t for name, t in weights.items()}


def floating_dtype(weights: dict) -> str:
    """The dtype the floating-point weights are stored in (the widest, should they differ)."""
    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()} or {torch.float32}
    return str(max(dtypes, key=lambda d: torch.finfo(d).bits)).removeprefix("torch.")


def record_dtype(config: dict, dtype: str) -> None:
    """The stored dtype in config.json as torch_dtype, and as transformers 5's `dtype` wherever a Llama
    config has that key (a format's own config, or the layer config the speculators format nests)."""
    config["torch_dtype"] = dtype
    for holder in (config, config.get("transformer_layer_config")):
        if isinstance(holder, dict) and "dtype" in holder:
            holder["dtype"] = dtype


def move_into_place(partial: Path, out_dir: Path) -> None:
    """The previous export (a folder, or whatever file was there) is moved aside, not deleted, until the new
    one is in place, and put back if the swap is interrupted."""
    previous = out_dir.with_name(out_dir.name + ".previous")
    remove(previous)
    try:
        if out_dir.exists() or out_dir.is_symlink():
            out_dir.rename(previous)
        partial.rename(out_dir)
    except BaseException:  # Ctrl-C included
        if (previous.exists() or previous.is_symlink()) and not out_dir.exists():
            previous.rename(out_dir)
        raise
    remove(previous)


CALIBRATION_FILE = "sts.json"  # per-position temperatures of the drafter's acceptance estimates (inference/calibration.py)


def load(path: Path) -> tuple[torch.nn.Module, str | None]:
    """(drafter, the verifier's name_or_path its config records) from an export of any supported format."""
    path = Path(path)
    config = read_config(path)
    fmt = format_of(config)
    if fmt is None:
        raise UserError(f"{path}: config.json is not in a drafter format this project reads "
                        f"(supported: {', '.join(name for name, f in FORMATS.items() if f.detect)})")
    spec = FORMATS[fmt]
    weights = read_weights(path / spec.weights_file)
    stored_dtype = floating_dtype(weights)
    if spec.extra_file is not None and (path / spec.extra_file).is_file():
        weights[spec.extra_file] = torch.load(path / spec.extra_file, map_location="cpu", weights_only=True)
    try:
        drafter, weights = spec.read(config, weights)
    except KeyError as e:  # a hand-edited or foreign config.json
        raise UserError(f"{path}/config.json has no {e.args[0]!r}, which a {fmt} export needs") from None
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    drafter.left_to_target = tuple(name for name in missing if name in spec.left_to_target)
    drafter.stored_dtype = stored_dtype  # what a conversion keeps unless told otherwise
    if (path / CALIBRATION_FILE).is_file():
        drafter.calibration_file = path / CALIBRATION_FILE
    missing = [name for name in missing if name not in drafter.left_to_target]  # share_target_embedding fills those
    if missing or unexpected:
        raise UserError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    return decoding_linears(drafter), spec.verifier(config)


def share_target_embedding(drafter, target) -> None:
    """Give a drafter exported without its embeddings (shared_embedding, the original DFlash layout) the
    target's, as vLLM does; and the target's lm_head and mask-token row where the export left those out."""
    with torch.no_grad():
        if "embed_tokens.weight" in drafter.left_to_target:
            drafter.embed_tokens.weight.copy_(target.embedding_weight().float())
        if "lm_head.weight" in drafter.left_to_target:
            drafter.lm_head.weight.copy_(target.lm_head_weight().float())
    if "mask_embedding" in drafter.left_to_target:
        drafter.reset_mask_embedding()
    drafter.left_to_target = ()


def serving(drafter, target, quant: str | None = None):
    """`drafter` ready to serve `target`: the target's tensors its export left out (share_target_embedding), on
    the target's device, in eval mode, its linear layers quantized with scheme `quant` (null: quant.serving_quant,
    int8 on a CPU). What it drafts changes a little; what the target emits does not (verification)."""
    share_target_embedding(drafter, target)
    drafter = drafter.eval().to(target.device)
    return quantized_linears(drafter, quant or serving_quant(target.device))


def set_best_k(path: Path, k: int) -> None:
    """Record in a speculators-format export the K measured fastest: its speculative_tokens, which vLLM, SGLang
    and this project's engine serve when the user sets no K. Other formats have no such field."""
    config = read_config(Path(path))
    if format_of(config) != "speculators":
        return
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    write_atomically(Path(path) / "config.json", json.dumps(config, indent=2))


def training_record(path: Path) -> dict | None:
    """training.json of an export written by this project (None for exports from elsewhere)."""
    record = Path(path) / "training.json"
    return json.loads(record.read_text()) if record.is_file() else None


def read_config(path: Path) -> dict:
    """config.json of an export, refusing a missing, truncated or corrupt file by name."""
    if not (path / "config.json").is_file():
        raise UserError(f"{path} is not a drafter export (no config.json)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}/config.json is corrupt or truncated ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}/config.json is corrupt: it holds a JSON {type(config).__name__}, not an object")
    return config


def read_weights(file: Path) -> dict:
    if not file.is_file():
        raise UserError(f"{file.parent} is not a complete drafter export (no {file.name})")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file} is corrupt or truncated ({e})") from None


def convert(source: Path, out: Path, fmt: str, target: str | None = None, overwrite: bool = False,
            dtype: str | None = None, shared_embedding: bool = False) -> Path:
    """The export `source` rewritten in format `fmt`: in the source's dtype unless `dtype`, without the
    embeddings it left to the target."""
    export_format(fmt)  # an unknown name refused, a format of your own imported
    check_writable(Path(out), overwrite)  # before the source loads
    drafter, verifier = load(source)
    if not (target or verifier):
        raise UserError(f"{source} does not name its target; pass target=<its name_or_path>")
    return save(drafter, out, Verifier.named(target or verifier), overwrite, training_record(source), fmt,
                dtype or drafter.stored_dtype, shared_embedding)


@dataclass
class ExportConfig:
    """conf/speculators/export.yaml: `python -m speculators.export source=<export dir> out=<out> [format=<format>]`."""

    source: str = MISSING  # an export folder
    out: str = MISSING  # a folder, or one file for format=gguf
    format: str = "speculators"  # a name of FORMATS, or the module name of a format of your own
    target: str | None = None  # the target's name_or_path, if the source format does not record it
    dtype: str | None = None  # e.g. bfloat16; None: the source's
    shared_embedding: bool = False  # leave out an EAGLE-3 drafter's embeddings
    overwrite: bool = False


def run(cfg: ExportConfig) -> None:
    print(convert(Path(cfg.source), Path(cfg.out), cfg.format, cfg.target, cfg.overwrite, cfg.dtype,
                  cfg.shared_embedding))


def main(argv: list[str] | None = None) -> None:
    """The command; `argv` (tests) stands for the command line's overrides."""
    from common.config import run_command

    if argv is not None:
        sys.argv[1:] = argv
    run_command("export", ExportConfig, run, config_dir="conf/speculators")


if __name__ == "__main__":
    main()
