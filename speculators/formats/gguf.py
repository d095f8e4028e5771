"""The gguf format: EAGLE-3 and DSpark drafters as one GGUF file that llama.cpp serves beside its target:
    llama-speculative-simple -m target.gguf -md draft.gguf --spec-type draft-eagle3 --spec-draft-n-max 4
(llama-server takes the same flags; a DSpark file: --spec-type draft-dspark, which llama.cpp also picks by
itself from the markov_w1 tensor). Written with gguf-py's GGUFWriter as llama.cpp's converter writes an
EAGLE-3 draft (conversion/llama.py in its source, `python convert_hf_to_gguf.py DRAFT --target-model-dir
TARGET`), and shaped as its loader reads one (src/models/eagle3.cpp, src/llama-model.cpp load_hparams):

- general.architecture "eagle3"; the draft layer's Llama hyperparameters under `eagle3.` (block_count 1,
  context_length, embedding_length, feed_forward_length, attention.head_count / head_count_kv /
  key_length / value_length / layer_norm_rms_epsilon, rope.dimension_count / freq_base, vocab_size =
  the target's); eagle3.target_layers (int32 [3]: layer id k = HF hidden_states[k], the input of target
  layer k, which llama.cpp extracts), eagle3.target_hidden_size, eagle3.norm_before_residual and
  eagle3.norm_before_fc (false: our drafter has no norm on fc's input).
- Tensors in llama.cpp's names (TENSOR_NAMES), matrices F16 (the converter's default; llama.cpp's CPU
  backend also serves BF16, but F16 keeps 3 more mantissa bits and converts in hardware with F16C), norms
  F32. Q and K rows are permuted as the converter does: our rotary pairs dimension i with i + d/2
  (speculators/layers.py apply_rotary), llama.cpp's Llama rope pairs 2i with 2i + 1.
- d2t as I64 holding absolute target ids (i + d2t[i], speculators/draft_vocab.py): the converter turns
  the speculators offsets into ids and llama.cpp scatters the draft logits to them. t2d is not stored.
- token_embd only when the drafter's embedding differs from the target's: without it llama.cpp reads the
  target's. Ours is a frozen copy (speculators/eagle3.py from_target), so it is normally omitted.
- The target's tokenizer: llama.cpp refuses a draft whose vocabulary differs from the target's
  (common/speculative.cpp common_speculative_are_compatible). From a GGUF target its tokenizer.* keys are
  copied as they are; from a Hugging Face target a byte-level BPE is written as the converter's gpt2
  vocabulary (no tokenizer.ggml.pre: the draft never tokenizes text; llama.cpp warns and uses its default).

DSpark drafters (speculators/dspark.py) are written as llama.cpp's converter writes our speculators export
(conversion/qwen.py DSparkModel, `convert_hf_to_gguf.py EXPORT --target-model-dir TARGET`) and served with
`--spec-type draft-dspark` (src/models/dflash.cpp): see `save_dspark` below.

Validated before anything is written: an EAGLE-3 or DSpark drafter (llama.cpp serves no other family here), valid d2t/t2d,
exactly 3 target layers inside the target, the target's embedding shape, every tensor's shape as
llama.cpp creates it. The export is one `*.gguf` file (what -md takes), written to a temporary sibling and
renamed into place. Written, not read back: the tokenizer comes from the target the source records or
`target=` (best: the .gguf llama.cpp will serve as the target).
"""

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGUFValueType, GGUFWriter, LlamaFileType, size_label
from gguf.quants import dequantize

from common.config import UserError
from common.files import check_writable, disk_error, sync_file
from speculators import draft_vocab, gguf_file
from speculators.formats import Format, register_format
from speculators.layers import rope_theta
from speculators.target import FrozenTarget, TargetConfig, check_layer_ids

ARCH = "eagle3"
# Our names -> llama.cpp's (its src/llama-arch.cpp LLM_TENSOR_NAMES; hidden_norm is ATTN_NORM_2).
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EMBEDDING = "token_embd.weight"


@dataclass
class Target:
    """What the file needs from the target the drafter is served with."""

    embedding: torch.Tensor  # [V, H] fp32, as the drafter copied it
    num_layers: int
    tokenizer: list[tuple[str, object, GGUFValueType, GGUFValueType | None]]  # (key, value, type, array type)


def save(drafter, out: Path, target_name: str, overwrite: bool = False) -> Path:
    """Write `drafter` as the GGUF file `out` for the target `target_name` (a GGUF file spec as
    speculators/gguf_file.py locates it, or a Hugging Face folder / hub id)."""

    out = Path(out)
    if out.suffix != ".gguf" or out.is_dir():
        raise UserError(f"{out}: a GGUF export is one file (what llama.cpp's -md takes); name it *.gguf")
    if drafter.cfg.family == "dspark":
        return save_dspark(drafter, out, target_name, overwrite)
    check_drafter(drafter)
    check_writable(out, overwrite)
    target = read_target(target_name, drafter.layer_ids)
    check_target(drafter, target)
    own_embedding = not (drafter.embedding_from_target  # exported without it: the target's
                         or torch.equal(drafter.embed_tokens.weight.detach().float().cpu(), target.embedding))
    tensors = gguf_tensors(drafter, write_embedding=own_embedding)
    check_shapes(drafter, tensors)
    write_atomically(out, lambda path: write(path, drafter, tensors, target.tokenizer))
    return out


def write_atomically(out: Path, write_to) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    try:
        write_to(partial)
        sync_file(partial)
        os.replace(partial, out)
    except OSError as error:  # a full disk, a read-only folder
        raise disk_error(out, error) from None
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def check_drafter(drafter) -> None:
    if drafter.cfg.family != "eagle3":
        raise UserError(f"llama.cpp serves EAGLE-3 drafters only (--spec-type draft-eagle3) and DSpark ones "
                        f"(draft-dspark), not {drafter.cfg.family}")
    if len(drafter.layer_ids) != 3:
        raise UserError(f"llama.cpp's EAGLE-3 reads exactly 3 target layers; this drafter reads {drafter.layer_ids}")
    if drafter.eagle31_flags:
        raise UserError(f"llama.cpp's EAGLE-3 has no {', '.join(drafter.eagle31_flags)} (EAGLE-3.1); export this "
                        f"drafter in the speculators format")
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)


def check_target(drafter, target: Target) -> None:
    check_layer_ids(drafter.layer_ids, target.num_layers)
    expected = (len(drafter.t2d), drafter.target_hidden_size)
    if tuple(target.embedding.shape) != expected:
        raise UserError(f"the target's embedding is {tuple(target.embedding.shape)} but the drafter was trained "
                        f"for [vocab, hidden] = {list(expected)}: another target?")


def read_target(name: str, layer_ids: list[int]) -> Target:
    if name.endswith(".gguf"):
        return gguf_target(gguf_file.locate(name))
    return hf_target(name, layer_ids)


def gguf_target(path: Path) -> Target:
    """Embedding dequantized as transformers' GGUF loader does (gguf-py), so a frozen copy compares equal."""
    reader = gguf_file.read(path)
    arch = gguf_file.field(reader, "general.architecture")
    embedding = next((t for t in reader.tensors if t.name == EMBEDDING), None)
    if embedding is None:
        raise UserError(f"{path}: no {EMBEDDING} tensor")
    tokenizer = [(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
                 for key, f in reader.fields.items() if key.startswith("tokenizer.")]
    return Target(torch.from_numpy(dequantize(embedding.data, embedding.tensor_type).astype(np.float32)),
                  gguf_file.field(reader, f"{arch}.block_count"), tokenizer)


def hf_target(name: str, layer_ids: list[int]) -> Target:
    # Without its decoder layers: their weights are not read.
    target = FrozenTarget.load(TargetConfig(name_or_path=name, layer_ids=list(layer_ids)), layers=False)
    embedding = target.embedding_weight().float()
    return Target(embedding, target.num_layers, hf_tokenizer(target.tokenizer, len(embedding)))


def hf_tokenizer(tokenizer, vocab_size: int) -> list:
    """A byte-level BPE as the converter's gpt2 vocabulary: tokens by id padded to the model's vocabulary
    with [PAD<id>] (type unused), special tokens control, other added tokens user-defined."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model["type"] != "BPE":
        raise UserError(f"the target's tokenizer is {model['type']}, not a byte-level BPE; convert the target "
                        f"with llama.cpp's convert_hf_to_gguf.py and export for that .gguf file")
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    special, added = set(tokenizer.all_special_ids), set(tokenizer.get_added_vocab().values())
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [5 if i not in by_id else 3 if i in special else 4 if i in added else 1 for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    fields = [("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING, None),
              ("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
              ("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32),
              ("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING)]
    for kind in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if token_id is not None:
            key = "padding" if kind == "pad" else "unknown" if kind == "unk" else kind
            fields.append((f"tokenizer.ggml.{key}_token_id", token_id, GGUFValueType.UINT32, None))
    for kind in ("bos", "eos"):  # as the converter: only when tokenizer_config.json says so
        if (add := tokenizer.init_kwargs.get(f"add_{kind}_token")) is not None:
            fields.append((f"tokenizer.ggml.add_{kind}_token", bool(add), GGUFValueType.BOOL, None))
    return fields


def rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Q/K rows in llama.cpp's rope order: within each head, row j of the first half and row j of the
    second half become rows 2j and 2j + 1 (the converter's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def stored(w: torch.Tensor) -> np.ndarray:
    """Norms F32; matrices F16 unless a value overflows it (then F32, rather than infinities)."""
    if w.dim() == 1:
        return w.numpy().astype(np.float32)
    half = w.half()
    return half.numpy() if bool(half.isfinite().all()) else w.numpy().astype(np.float32)


def gguf_tensors(drafter, write_embedding: bool) -> dict[str, np.ndarray]:
    """llama.cpp name -> array in PyTorch's [out, in] order (GGUFWriter stores the reverse, ggml's ne)."""
    state = {name: t.detach().float().cpu() for name, t in drafter.state_dict().items()}
    c = drafter.layer_cfg
    state["layers.0.self_attn.q_proj.weight"] = rope_rows(state["layers.0.self_attn.q_proj.weight"],
                                                          c.num_attention_heads)
    state["layers.0.self_attn.k_proj.weight"] = rope_rows(state["layers.0.self_attn.k_proj.weight"],
                                                          c.num_key_value_heads)
    tensors = {theirs: stored(state[ours]) for ours, theirs in TENSOR_NAMES.items()}
    if write_embedding:
        tensors[EMBEDDING] = stored(state["embed_tokens.weight"])
    tensors["d2t"] = draft_vocab.target_ids(drafter.d2t).cpu().numpy().astype(np.int64)
    return tensors


def expected_shapes(drafter) -> dict[str, tuple[int, ...]]:
    """ggml shapes (ne: innermost first) llama.cpp's load_arch_tensors creates for this drafter."""
    c = drafter.layer_cfg
    H, ff, q, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    norms = ("blk.0.attn_norm.weight", "blk.0.attn_norm_2.weight", "blk.0.ffn_norm.weight", "output_norm.weight")
    return {name: (H,) for name in norms} | {
        "fc.weight": (len(drafter.layer_ids) * drafter.target_hidden_size, H),
        "blk.0.attn_q.weight": (2 * H, q), "blk.0.attn_k.weight": (2 * H, kv), "blk.0.attn_v.weight": (2 * H, kv),
        "blk.0.attn_output.weight": (q, H),
        "blk.0.ffn_gate.weight": (H, ff), "blk.0.ffn_up.weight": (H, ff), "blk.0.ffn_down.weight": (ff, H),
        "output.weight": (H, drafter.cfg.draft_vocab_size), EMBEDDING: (H, len(drafter.t2d)),
        "d2t": (drafter.cfg.draft_vocab_size,),
    }


def check_shapes(drafter, tensors: dict[str, np.ndarray]) -> None:
    expected = expected_shapes(drafter)
    for name, array in tensors.items():
        if tuple(reversed(array.shape)) != expected[name]:
            raise UserError(f"{name}: shape {tuple(reversed(array.shape))} (ggml order), llama.cpp expects "
                            f"{expected[name]}")


def write(path: Path, drafter, tensors: dict[str, np.ndarray], tokenizer: list) -> None:
    c = drafter.layer_cfg
    writer = GGUFWriter(path, ARCH)  # writes general.architecture
    writer.add_block_count(1)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(rope_theta(c))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(len(drafter.t2d))
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    # The EAGLE-3 keys (the installed gguf-py predates their add_* helpers). target_layers must be a 32-bit
    # integer array (llama_model_loader::get_arr).
    writer.add_key_value(f"{ARCH}.target_layers", list(drafter.layer_ids), GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_key_value(f"{ARCH}.target_hidden_size", drafter.target_hidden_size, GGUFValueType.UINT32)
    writer.add_key_value(f"{ARCH}.norm_before_residual", drafter.cfg.norm_before_residual, GGUFValueType.BOOL)
    writer.add_key_value(f"{ARCH}.norm_before_fc", False, GGUFValueType.BOOL)
    for key, value, kind, sub_type in tokenizer:
        writer.add_key_value(key, value, kind, sub_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array)  # the array's dtype gives the type: F16, F32, I64 (d2t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- DSpark: llama.cpp's "dflash" architecture with the Markov and confidence heads ----------------------------

DSPARK_ARCH = "dflash"
# Ours -> llama.cpp's, per draft layer (gguf-py's tensor_mapping for DFlash: Qwen3 layers, no permutation,
# since our rotary is NeoX's, llama.cpp's rope for this architecture).
DSPARK_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
DSPARK_NAMES = {
    "embed_tokens.weight": EMBEDDING,  # the target's rows with the learned mask row folded in
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",  # only for a reduced draft vocabulary, as the converter
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}


def save_dspark(drafter, out: Path, target_name: str, overwrite: bool) -> Path:
    """A DSpark drafter as the GGUF llama.cpp's converter writes from our speculators export of it:
    general.architecture "dflash"; under `dflash.` the draft layers' Qwen3 hyperparameters (block_count,
    context_length, embedding_length, feed_forward_length, attention.head_count / head_count_kv / key_length /
    value_length / layer_norm_rms_epsilon, rope.freq_base), block_size, target_layers (our layer ids as they
    are: llama.cpp extracts the input of layer k, HF hidden_states[k]), sample_from_anchor (true: every slot
    drafts) and has_confidence_head; tokenizer.ggml.mask_token_id and the target's tokenizer. Tensors: the
    draft layers (blk.N.*), fc, enc.output_norm (our hidden_norm), output_norm, token_embd (its mask row
    learned: always written, llama.cpp would otherwise embed with the target's untrained row), output (the
    draft-vocabulary lm_head; left out, as by the converter, only when it is token_embd itself), d2t (I64
    absolute target ids, [N]), markov_w1 [V, r], markov_w2 [r -> N],
    conf_proj [H + r -> 1] with its bias. Matrices F16, vectors F32 (the converter's --outtype f16).
    llama.cpp's Markov head is the vanilla one and its confidence head reads [hidden, W1[previous token]]:
    other heads are refused in one line."""
    check_dspark(drafter)
    check_writable(out, overwrite)
    target = read_target(target_name, drafter.layer_ids)
    check_layer_ids(drafter.layer_ids, target.num_layers)
    if tuple(target.embedding.shape) != tuple(drafter.embed_tokens.weight.shape):
        raise UserError(f"the target's embedding is {tuple(target.embedding.shape)} but the drafter was trained "
                        f"for {tuple(drafter.embed_tokens.weight.shape)}: another target?")
    tensors = dspark_tensors(drafter)
    write_atomically(out, lambda path: write_dspark(path, drafter, tensors, target.tokenizer))
    return out


def check_dspark(drafter) -> None:
    cfg = drafter.cfg
    if cfg.markov_head_type != "vanilla":
        raise UserError(f"llama.cpp's draft-dspark has the vanilla Markov head only, not {cfg.markov_head_type!r}; "
                        f"export this drafter in the speculators format (vLLM)")
    if not cfg.confidence_with_markov:
        raise UserError("llama.cpp's DSpark confidence head reads [hidden, W1[previous token]]; this drafter's reads "
                        "the hidden state only: export it in the speculators format")
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), cfg.draft_vocab_size)


def dspark_tensors(drafter) -> dict[str, np.ndarray]:
    """llama.cpp name -> array in PyTorch's [out, in] order (the mask embedding folded into token_embd)."""
    state = {name: t.detach().float().cpu() for name, t in drafter.state_dict().items()}
    names = dict(DSPARK_NAMES)
    if drafter.cfg.draft_vocab_size == len(drafter.t2d) and torch.equal(state["lm_head.weight"],
                                                                        state["embed_tokens.weight"]):
        # The converter drops a full-vocabulary lm_head and llama.cpp then projects with token_embd; it is
        # kept here when it differs (an untied target), else those drafts would come from the wrong matrix.
        del names["lm_head.weight"]
    names |= {f"layers.{i}.{ours}": f"blk.{i}.{theirs}"
              for i in range(len(drafter.layers)) for ours, theirs in DSPARK_LAYER_NAMES.items()}
    tensors = {theirs: stored(state[ours]) for ours, theirs in names.items()}
    tensors["d2t"] = draft_vocab.target_ids(drafter.d2t).cpu().numpy().astype(np.int64)  # as the converter: always
    return tensors


def write_dspark(path: Path, drafter, tensors: dict[str, np.ndarray], tokenizer: list) -> None:
    c = drafter.layer_cfg
    writer = GGUFWriter(path, DSPARK_ARCH)
    writer.add_type("model")
    writer.add_name(Path(path).name.removesuffix(".partial").removesuffix(".gguf"))
    weights = sum(t.numel() for t in drafter.state_dict().values())  # the converter counts the export's tensors
    writer.add_size_label(size_label(weights, 0, 0, 0))
    writer.add_block_count(len(drafter.layers))
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta(c))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_uint32(f"{DSPARK_ARCH}.block_size", drafter.cfg.block_size)
    writer.add_key_value(f"{DSPARK_ARCH}.target_layers", list(drafter.layer_ids), GGUFValueType.ARRAY,
                         GGUFValueType.INT32)
    writer.add_bool(f"{DSPARK_ARCH}.sample_from_anchor", True)
    writer.add_bool(f"{DSPARK_ARCH}.has_confidence_head", True)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_uint32("tokenizer.ggml.mask_token_id", drafter.cfg.mask_token_id)
    for key, value, kind, sub_type in tokenizer:
        writer.add_key_value(key, value, kind, sub_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


register_format(Format("gguf", None, None, None, families=("dspark",), save=lambda drafter, out, verifier, overwrite:
                       save(drafter, out, verifier.name_or_path, overwrite)))
