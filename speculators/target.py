"""The frozen target: any Hugging Face causal LM, its tokenizer, and the features drafters learn from.

HF `hidden_states[k]` is the residual stream after k decoder layers (0 = embeddings);
`hidden_states[L]` is after the final norm, the input of lm_head. Layer ids everywhere in
this project (configs, exports) use that same k.

A target larger than one device loads through accelerate's big-model support: with
`device_map` (e.g. "auto") its layers are spread over the GPUs, then CPU RAM, then disk
(`offload_folder`), each device capped by `max_memory`; accelerate's hooks move activations
from layer to layer, and the outputs come back to the device of the input ids.

A target loaded with `layers=False` has its embeddings, final norm and lm_head but no decoder
layers: training from a hidden-state cache (train/hidden_cache.py) needs no more than that.
"""

import hashlib
import inspect
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils.modeling import align_module_device
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from common.config import UserError, one_of, require
from speculators import gguf_file
from speculators.layers import decoding_linears
from speculators.quant import QuantConfig, check_gguf_source, quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NO_TARGET = ("no target: pass target.name_or_path=<folder or hub id> (or target.gguf_file=<model.gguf>, or a "
             "conf/target/ file: target=smollm2)")
LOGITS = ("all", "last", "none")  # the positions whose logits FrozenTarget.__call__ returns


# Config properties after which a target serves logits other than lm_head(hidden_states[L]): (what it does, the
# value that leaves logits as they are, the transform transformers and vLLM apply). head_logits applies them, so
# logits recomputed from cached hidden states are the served ones.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": ("soft-caps its logits at {}: c tanh(z / c)", None, lambda z, c: c * torch.tanh(z / c)),
    "logits_scaling": ("divides its logits by {}", 1.0, lambda z, s: z / s),
    "logit_scale": ("multiplies its logits by {}", 1.0, lambda z, s: z * s),
    "lm_head_multiplier": ("multiplies its logits by {}", 1.0, lambda z, s: z * s),
}


def missing_folder(name_or_path) -> str | None:
    """Why a target named like a local path did not load, where the folder is not there (not a bad hub id)."""
    path = Path(str(name_or_path))
    looks_local = path.is_absolute() or str(name_or_path).startswith((".", "~")) or path.parent.is_dir() and \
        str(path.parent) not in ("", ".")
    if looks_local and not path.expanduser().exists():
        return f"no such folder {path} (a local target folder, or a hub id such as org/name)"
    return None


def auto_dtype() -> tuple[str, str]:
    """The target's dtype when none is set, and why: bf16 on a GPU, fp32 on a CPU, where bf16 arithmetic is
    ~30x slower."""
    return ("bfloat16", "auto: a CUDA GPU") if torch.cuda.is_available() else ("float32", "auto: no GPU")


@dataclass
class TargetConfig:
    name_or_path: str | None = None  # a local folder or a hub id
    gguf_file: str | None = None  # instead: a GGUF file, or <package>/<file> in an installed package (speculators/gguf_file.py)
    layer_ids: list[int] | None = None  # EAGLE-3 feature layers; None: [2, L//2, L-3]
    dtype: str | None = None  # None: the device's (auto_dtype)
    trust_remote_code: bool = False
    device_map: str | None = None  # accelerate's big-model loading: "auto", "balanced", "sequential"; None: one device
    max_memory: dict | None = None  # device -> cap with device_map, e.g. {0: 20GiB, cpu: 60GiB}; beyond it, offload_folder
    offload_folder: str | None = None  # disk for the layers that fit nowhere else (device_map only)

    def __post_init__(self):
        if self.name_or_path is None and self.gguf_file is None:  # conf=eagle3 (conf/target/yours.yaml) names none
            raise UserError(NO_TARGET)
        require((self.name_or_path is None) != (self.gguf_file is None), "target.name_or_path", self.name_or_path,
                "set when target.gguf_file is not, and null when it is (one source of weights)")
        if self.dtype is None:
            self.dtype, self._dtype_reason = auto_dtype()
        one_of("target.dtype", self.dtype, DTYPES)
        one_of("target.device_map", self.device_map, (None, "auto", "balanced", "balanced_low_0", "sequential"))
        for key in ("max_memory", "offload_folder"):
            require(getattr(self, key) is None or self.device_map is not None, f"target.{key}", getattr(self, key),
                    "null unless target.device_map is set (it places the layers)")

    @classmethod
    def named(cls, name: str, **options) -> "TargetConfig":
        """The target an export records: a GGUF file spec (ends with .gguf) or a folder / hub id."""
        return cls(gguf_file=name, **options) if name.endswith(".gguf") else cls(name_or_path=name, **options)

    @property
    def name(self) -> str:
        """What exports and reports record as the target."""
        return self.gguf_file or self.name_or_path

    def big_model_options(self) -> dict:
        """from_pretrained's keyword arguments for accelerate's placement, if asked for."""
        if self.device_map is None:
            return {}
        memory = None if self.max_memory is None else {int(k) if str(k).isdigit() else k: v
                                                       for k, v in self.max_memory.items()}
        return {"device_map": self.device_map, "max_memory": memory, "offload_folder": self.offload_folder}


@dataclass
class TargetShape:
    """A target's sizes as its config (a GGUF file: its header) states them, read without loading a
    weight: what Drafter.check reads of a FrozenTarget, so a drafter it cannot serve is refused first."""

    name_or_path: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def read(cls, cfg: TargetConfig) -> "TargetShape":
        if cfg.gguf_file:
            return cls.of_gguf(cfg.gguf_file)
        try:
            config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            reason = missing_folder(cfg.name_or_path) or str(e).splitlines()[0]
            raise UserError(f"cannot load target {cfg.name!r}: {reason}") from None
        text = config.get_text_config()
        return cls(cfg.name, text.hidden_size, text.vocab_size, text.num_hidden_layers)

    @classmethod
    def of_gguf(cls, spec: str) -> "TargetShape":
        """From the header alone: no conversion (the first load of a GGUF converts it)."""
        reader = gguf_file.read(gguf_file.locate(spec))
        arch = gguf_file.field(reader, "general.architecture")
        vocab_size = gguf_file.field(reader, f"{arch}.vocab_size") or len(gguf_file.field(reader, "tokenizer.ggml.tokens"))
        return cls(spec, gguf_file.field(reader, f"{arch}.embedding_length"), vocab_size,
                   gguf_file.field(reader, f"{arch}.block_count"))

    def fingerprint(self) -> None:
        """Unknown until the weights load (FrozenTarget.fingerprint)."""
        return None


@dataclass
class TargetOutput:
    aux_hidden: list[torch.Tensor]  # hidden_states[k] for k in layer_ids, each [B, T, H]
    last_hidden: torch.Tensor  # hidden_states[L]: after the final norm, [B, T, H]
    logits: torch.Tensor | None  # [B, T, V]; None when not asked for, or when `head` computes them on demand
    greedy: torch.Tensor | None = None  # [B, T] the argmax of the logits, when known without them (a cache stores it)
    head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None  # (hidden, vocab ids) -> logits

    def argmax(self) -> torch.Tensor:
        """The target's greedy next token at every position, [B, T]."""
        return self.greedy if self.greedy is not None else self.full_logits().argmax(-1)

    def logits_at(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits of vocab ids `ids` [n] at every position, [B, T, n]. From a hidden-state cache only those
        rows of lm_head are computed (a draft vocab of 8,192 of SmolLM2's 49,152: a sixth of the product)."""
        if self.logits is not None:
            return self.logits.index_select(-1, ids)
        return self.head(self.last_hidden, ids)

    def full_logits(self) -> torch.Tensor:
        """[B, T, V], computed once from the last hidden state when a cache stood in for them."""
        if self.logits is None:
            self.logits = self.head(self.last_hidden, None)
        return self.logits


def default_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """Distinct ids in [0, L): the residual stream after k layers feeds the drafter."""
    bad = [k for k in layer_ids if not 0 <= k < num_layers]
    if bad:
        raise UserError(f"target.layer_ids {layer_ids}: {bad} out of range for a target of {num_layers} layers "
                        f"(valid: 0..{num_layers - 1}); small targets need explicit ids, e.g. target.layer_ids=[0,1,2]")
    if len(set(layer_ids)) != len(layer_ids):
        raise UserError(f"target.layer_ids {layer_ids} has duplicates; the drafter needs distinct layers (small targets need explicit ids, e.g. target.layer_ids=[0,1,2])")
    return list(layer_ids)


class FrozenTarget:
    """A causal LM in eval mode with gradients off. Not an nn.Module on purpose: whatever holds
    it (a LightningModule) does not put its weights in the optimizer or in checkpoints."""

    def __init__(self, model, tokenizer, name_or_path: str, layer_ids: list[int] | None = None, layers: bool = True,
                 fingerprint: str | None = None):
        self.model = model.eval().requires_grad_(False)
        self._fingerprint = fingerprint or weights_fingerprint(model)
        self.layers = layers  # False: loaded without its decoder layers, it turns cached hidden states into logits
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        self.config = model.config.get_text_config()  # a multimodal checkpoint's language model: what is served
        self.num_layers = self.config.num_hidden_layers
        self.hidden_size = self.config.hidden_size
        self.image_token_id = image_token_id(model.config)
        self.logit_transforms = logit_transforms(self.config)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layer_ids = check_layer_ids(default_layer_ids(self.num_layers) if layer_ids is None else layer_ids,
                                         self.num_layers)
        # transformers 5.24 renamed forward's past_key_values to cache (the old name warns; removed in 5.40).
        self.cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.can_skip_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._head_rows = None  # (vocab ids, their lm_head rows, their bias): head_logits' last restriction

    @classmethod
    def load(cls, cfg: TargetConfig, quant: QuantConfig = QuantConfig(), layers: bool = True) -> "FrozenTarget":
        """`layers=False`: build the model with zero decoder layers, so their weights are never read."""
        if cfg.device_map is not None and quant.scheme != "none":
            raise UserError(f"quant.scheme={quant.scheme} with target.device_map={cfg.device_map}: quantization "
                            f"replaces layers that accelerate has placed; use one or the other")
        source = gguf_file.locate(cfg.gguf_file) if cfg.gguf_file else None
        check_gguf_source(quant, source)  # before the weights load
        if hasattr(cfg, "_dtype_reason"):
            print(f"target dtype: {cfg.dtype} ({cfg._dtype_reason})", flush=True)
        folder = gguf_file.converted_folder(cfg.gguf_file) if cfg.gguf_file else cfg.name_or_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
            config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
            num_layers = config.get_text_config().num_hidden_layers
            config.get_text_config().num_hidden_layers = num_layers if layers else 0
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # without layers, transformers reports every layer weight as unexpected
            try:
                model = model_class(config).from_pretrained(folder, config=config, dtype=DTYPES[cfg.dtype],
                                                             trust_remote_code=cfg.trust_remote_code,
                                                             **cfg.big_model_options())
            finally:
                hf_logging.set_verbosity(verbosity)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load target {cfg.name!r}: {missing_folder(folder) or str(e).splitlines()[0]}") from None
        model.config.get_text_config().num_hidden_layers = num_layers  # what the drafter and the exports describe is the whole target
        fingerprint = weights_fingerprint(model)  # of the weights as stored: serving quantized is the same target
        model = decoding_linears(quantize(model, quant, tokenizer, source))  # few-row CPU products through our kernel
        return cls(model, tokenizer, cfg.name, cfg.layer_ids, layers, fingerprint)

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a recurrent or conv state instead of keys and values (linear attention,
        state-space: Qwen3-Next, LFM2, GraniteMoeHybrid), by transformers' cache layout for the config."""
        return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=self.config).layers)

    @property
    def placed(self) -> bool:
        """Placed by accelerate (target.device_map): its layers stay where they are."""
        return getattr(self.model, "hf_device_map", None) is not None

    @property
    def device(self) -> torch.device:
        """Where input ids go: the embeddings' device; a placed target's hooks move them from the CPU."""
        if self.placed:
            return torch.device("cpu")
        # A tensor the embeddings hold, not .weight: a quantized table's .weight dequantizes all of it.
        return next(itertools.chain(self.embed_tokens.parameters(), self.embed_tokens.buffers())).device

    def to(self, device) -> "FrozenTarget":
        if not self.placed:
            self.model.to(device)
        return self

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    def embedding_weight(self) -> torch.Tensor:
        """The input embeddings [V, H], wherever accelerate keeps them: drafters start from copies."""
        with align_module_device(self.embed_tokens):
            return self.embed_tokens.weight.detach().clone()

    def lm_head_weight(self) -> torch.Tensor:
        """lm_head's weight [V, H], wherever accelerate keeps it."""
        head = self.model.get_output_embeddings()
        with align_module_device(head):
            return head.weight.detach().clone()

    def fingerprint(self) -> str:
        """Which target this is, however it is served (weights_fingerprint before quantization)."""
        return self._fingerprint

    @torch.no_grad()
    def from_hidden(self, aux_hidden: list[torch.Tensor], last_hidden: torch.Tensor,
                    greedy: torch.Tensor | None = None) -> TargetOutput:
        """What __call__ returns, from hidden states computed earlier: logits are lm_head(hidden_states[L]). Given
        the target's argmax (`greedy`, [B, T]), they are computed on demand, only for the vocab ids asked for."""
        if greedy is None:
            logits = self.head_logits(last_hidden)
        return TargetOutput(aux_hidden=[h.float() for h in aux_hidden], last_hidden=last_hidden.float(),
                            logits=None if greedy is not None else logits, greedy=greedy, head=self.head_logits)

    @torch.no_grad()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden_states[L] in float32 from the last decoder layer's output before the final norm (what vLLM's
        hidden-state extraction gives)."""
        base = self.model.base_model
        if base is self.model:  # base_model_prefix names no attribute (Llama-4 text: "language_model", held as model)
            base = getattr(self.model, "model", base)
        base = getattr(base, "language_model", base)  # a multimodal checkpoint: its language model's norm
        names = ("norm", "final_layernorm", "ln_f", "norm_f", "embedding_norm")  # Nemotron-H: norm_f; LFM2: embedding_norm
        norm = next((getattr(base, name) for name in names if hasattr(base, name)), None)
        if norm is None:
            raise UserError(f"target {self.name_or_path}: no final norm found ({', '.join(names)}) to finish "
                            "the last layer's hidden states")
        with align_module_device(norm):
            weight_device = next(norm.parameters()).device
            return norm(hidden.to(weight_device, self.model.dtype)).float()

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head(hidden) in float32, [..., V]; given vocab ids [n], only theirs, [..., n], from those rows of
        lm_head (dequantized once per `ids` tensor and kept: a drafter passes the same one every step)."""
        head = self.model.get_output_embeddings()
        if ids is None:
            return self.served_logits(head(hidden.to(self.model.dtype)).float())
        if self._head_rows is None or self._head_rows[0] is not ids:
            with align_module_device(head):
                rows = head.rows(ids) if hasattr(head, "rows") else head.weight[ids]
                bias = None if getattr(head, "bias", None) is None else head.bias[ids].float()
            self._head_rows = (ids, rows.float().to(hidden.device), bias)
        _, rows, bias = self._head_rows
        out = hidden.float() @ rows.T
        return self.served_logits(out if bias is None else out + bias)

    def served_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head's output through the target's own soft-capping or scaling (LOGIT_TRANSFORMS), elementwise."""
        for name, value in self.logit_transforms:
            logits = LOGIT_TRANSFORMS[name][2](logits, value)
        return logits

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 cache=None, position_ids: torch.Tensor | None = None, logits: str = "all") -> TargetOutput:
        """Features of every position and logits of `logits`: "all", "last" (a prompt's prefill decides the next
        token alone) or "none"; with a transformers Cache, continue after it. lm_head over a whole row is a fifth
        of SmolLM2-135M's forward."""
        if not self.layers:
            raise RuntimeError("this target was loaded without its decoder layers (layers=False)")
        if self.image_token_id is not None and bool((input_ids == self.image_token_id).any()):
            raise UserError(f"target {self.name_or_path} is multimodal: its language model is trained against and "
                            f"served with text only, and these tokens hold an image (token {self.image_token_id})")
        cache_kwarg = {self.cache_kwarg: cache} if cache is not None else {}
        if logits not in LOGITS:
            raise ValueError(f"logits={logits!r}: one of {', '.join(LOGITS)}")
        head_kwarg = {} if logits == "all" or not self.can_skip_logits else {"logits_to_keep": 1}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=cache is not None, output_hidden_states=True, **cache_kwarg, **head_kwarg)
        device = input_ids.device  # a placed target's outputs come from the devices of its last layers
        kept = out.logits if logits == "all" else out.logits[:, -1:]  # where logits_to_keep could not
        return TargetOutput(aux_hidden=[out.hidden_states[k].to(device, torch.float32) for k in self.layer_ids],
                            last_hidden=out.hidden_states[-1].to(device, torch.float32),
                            logits=None if logits == "none" else kept.to(device, torch.float32))


def logit_transforms(config) -> list[tuple[str, float]]:
    """(property, value) of every LOGIT_TRANSFORMS property `config` sets to other than its neutral value."""
    found = ((name, getattr(config, name, None)) for name in LOGIT_TRANSFORMS)
    return [(name, float(value)) for name, value in found if value not in (None, 0, LOGIT_TRANSFORMS[name][1])]


def describe_logits(target: "FrozenTarget") -> str:
    """How the target's logits follow from its last hidden state, naming each property that changes them."""
    steps = [LOGIT_TRANSFORMS[name][0].format(f"{name}={value:g}") for name, value in target.logit_transforms]
    return "lm_head(final hidden state)" + "".join(f", then it {step}" for step in steps)


def check_logits_from_hidden(target: "FrozenTarget", out: TargetOutput, remedy: str) -> None:
    """The logits a forward served (`out`) are those recomputed from its hidden states, as a cache of hidden
    states recomputes them (head_logits): one line naming the properties applied if not, and `remedy`."""
    recomputed = target.from_hidden(out.aux_hidden, out.last_hidden).logits
    if not torch.allclose(recomputed, out.logits, rtol=1e-4, atol=1e-4):
        raise UserError(f"target {target.name_or_path}: its served logits are not {describe_logits(target)}; a "
                        f"property of its config that this project does not apply changes them; {remedy}")


def check_logits_known(target: "FrozenTarget", remedy: str) -> None:
    """Without a forward to compare against (a cache through vLLM reads hidden states alone): one line naming any
    config property that looks like it changes the logits (its name) and is not one head_logits applies."""
    unknown = {name: value for name, value in target.config.to_dict().items()
               if LOGIT_LIKE.search(name) and not NOT_LOGITS.search(name) and name not in LOGIT_TRANSFORMS
               and value not in (None, False, 0, 1, 1.0)}
    if unknown:
        found = ", ".join(f"{name}={value}" for name, value in unknown.items())
        raise UserError(f"target {target.name_or_path}: {found} may change its served logits, which this project "
                        f"recomputes as {describe_logits(target)}; {remedy}")


LOGIT_LIKE = re.compile(r"logit|lm_head_mult|output_mult")
NOT_LOGITS = re.compile(r"router|attn|attention|num_logits|aux|init|output_logits")  # inside the model, or not served


def model_class(config):
    """AutoModelForCausalLM; for the multimodal checkpoints it does not know (Qwen-VL), their image-text class,
    whose language model is then served with text alone."""
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "auto_map", None):
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def image_token_id(config) -> int | None:
    """The token a multimodal checkpoint puts where an image goes (None for a text-only target)."""
    if config.get_text_config() is config:
        return None
    found = (getattr(config, name, None) for name in ("image_token_id", "image_token_index"))
    return next((i for i in found if i is not None), None)


def weights_fingerprint(model) -> str:
    """A hash of the config, the weight dtype and 256 rows each of the embeddings and lm_head:
    the same whether or not the decoder layers are loaded (a target differing in those alone
    and saved under the same name is not told apart)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(str(model.dtype).encode())
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        with align_module_device(module):  # weights offloaded by accelerate (target.device_map), read back
            state = module.state_dict()
        for name, tensor in sorted(state.items()):
            rows = tensor[:: max(1, len(tensor) // 256)] if tensor.dim() > 1 else tensor.reshape(1, -1)
            digest.update(name.encode() + rows.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
