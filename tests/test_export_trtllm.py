"""--format trtllm: ModelOpt 0.47's EAGLE-3 export layout, which TensorRT-LLM's PyTorch backend serves, checked
key by key and value by value against ModelOpt's exporter run on the same weights (downloaded on demand,
skipped offline) and against its keys and values spelled out from its source; the serving YAML beside it."""

import copy
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import LAYER_IDS
from safetensors.torch import load_file
from transformers import LlamaConfig

from common.config import UserError
from speculators import export
from speculators.export import Verifier
from speculators.formats import trtllm as export_trtllm

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-eagle3"
SHIPPED_TARGET_LAYERS = 30  # SmolLM2-135M; the drafter reads our layers [2, 15, 27] = [2, L//2, L-3]
MODELOPT_VERSION = "0.47.0"

# What ModelOpt 0.47 writes for the shipped drafter's weights, read from its source:
# modelopt/torch/export/plugins/hf_spec_configs.py llama_eagle_template_config (these keys, in this order),
# filled by hf_spec_export.py EagleExporter._export_config from the draft config (else the base model's);
# eagle_config's settings are those of an EAGLE-3 drafter with a final norm (use_last_layernorm, which
# LLAMA_EAGLE_SINGLE_LAYER's required `norm` needs) and ModelOpt's defaults
# (modelopt/torch/speculative/eagle/default_config.py default_eagle_config). Its layer ids are the layers
# whose output it hooks (modelopt/torch/speculative/plugins/hf_eagle.py HFEagleModel.modify): ours minus one.
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.02,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 1,
    "pad_token_id": None,
    "rms_norm_eps": 9.999999747378752e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": transformers.__version__,  # the writer's, as ModelOpt and save_pretrained record it
    "use_cache": True,
    "vocab_size": 49152,
    "draft_vocab_size": 8192,
    "rope_scaling": {"rope_type": "default", "rope_theta": 100000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 64,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rope_theta": 100000.0,
    "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 14, 26],
        "use_aux_hidden_state": True,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "use_mtp_layernorm": False,
        "next_layer_regular": True,
        "parallel_draft_step": 1,
        "parallel_draft_heads_num_layers": 1,
    },
}
# hf_spec_export.py LLAMA_EAGLE_SINGLE_LAYER (required, and optional d2t and lm_head) as
# EagleExporter._extract_state_dict writes them: the eagle module's names without `eagle_module.`; q/k/v
# take [input embedding, hidden] (modeling_eagle.py EagleModule._expand_first_attn_in_dim: 2 * 576 wide),
# fc the three target layers (3 * 576); d2t int64 (EagleModule's buffer), the rest in the stored dtype.
H, KV, MLP, N = 576, 192, 1536, 8192
EXPECTED_WEIGHTS = {
    "layers.0.self_attn.q_proj.weight": (H, 2 * H),
    "layers.0.self_attn.k_proj.weight": (KV, 2 * H),
    "layers.0.self_attn.v_proj.weight": (KV, 2 * H),
    "layers.0.self_attn.o_proj.weight": (H, H),
    "layers.0.mlp.gate_proj.weight": (MLP, H),
    "layers.0.mlp.up_proj.weight": (MLP, H),
    "layers.0.mlp.down_proj.weight": (H, MLP),
    "layers.0.hidden_norm.weight": (H,),
    "layers.0.input_layernorm.weight": (H,),
    "layers.0.post_attention_layernorm.weight": (H,),
    "norm.weight": (H,),
    "fc.weight": (H, 3 * H),
    "lm_head.weight": (N, H),
    "d2t": (N,),
}


@pytest.fixture(scope="module")
def shipped_export(tmp_path_factory) -> Path:
    return export.convert(SHIPPED, tmp_path_factory.mktemp("trtllm") / "draft", "trtllm")


@pytest.fixture(scope="module")
def shipped_drafter():
    drafter, _ = export.load(SHIPPED)
    return drafter


def test_shipped_drafter_is_what_modelopt_writes(shipped_export, shipped_drafter):
    """Spelled out from ModelOpt's source: a differing key, key order, value, name, shape or dtype fails."""
    config = json.loads((shipped_export / "config.json").read_text())
    assert list(config) == list(EXPECTED_CONFIG)
    for key, value in EXPECTED_CONFIG.items():
        assert config[key] == value, key
    weights = load_file(shipped_export / "model.safetensors")
    assert sorted(weights) == sorted(EXPECTED_WEIGHTS)
    source = shipped_drafter.state_dict()
    for name, shape in EXPECTED_WEIGHTS.items():
        assert tuple(weights[name].shape) == shape, name
        assert weights[name].dtype == (torch.int64 if name == "d2t" else torch.bfloat16), name
        assert torch.equal(weights[name], source[name].to(weights[name].dtype)), name


def test_serving_yaml_captures_the_same_layers_in_trtllm_numbering(shipped_export):
    text = (shipped_export / export_trtllm.SERVING_FILE).read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == ["speculative_config:", "  decoding_type: Eagle3", "  max_draft_len: 2",
                     f"  speculative_model: {json.dumps(str(shipped_export.resolve()))}",
                     "  eagle3_layers_to_capture: [1, 14, 26]"]


@pytest.mark.parametrize("num_layers", [16, 24, 30, 32, 80])
def test_our_default_layers_are_trtllm_and_modelopt_default_taps(num_layers):
    """Their default {1, L//2-1, L-4} (modelopt/torch/speculative/plugins/hf_eagle.py
    default_eagle_aux_layer_ids; TensorRT-LLM's eagle3_layers_to_capture default) is our [2, L//2, L-3]."""
    L = num_layers
    assert export_trtllm.capture_layers([2, L // 2, L - 3]) == sorted({1, L // 2 - 1, L - 4})


def test_shipped_drafter_equals_modelopts_export_of_the_same_weights(shipped_export, shipped_drafter, tmp_path):
    """ModelOpt 0.47's own EagleExporter, run on CPU on a stand-in of a ModelOpt EAGLE-3 model that holds
    the shipped drafter's weights: its folder equals ours file by file, key by key, value by value."""
    exporter = modelopt_exporter_module()
    model = modelopt_model(shipped_drafter, SHIPPED_TARGET_LAYERS)
    exporter.EagleExporter(model).export(tmp_path / "modelopt")
    theirs = json.loads((tmp_path / "modelopt" / "config.json").read_text())
    ours = json.loads((shipped_export / "config.json").read_text())
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key] == theirs[key], key
    their_weights = load_file(tmp_path / "modelopt" / "model.safetensors")
    our_weights = load_file(shipped_export / "model.safetensors")
    assert sorted(our_weights) == sorted(their_weights)
    for name, tensor in their_weights.items():
        assert our_weights[name].shape == tensor.shape and our_weights[name].dtype == tensor.dtype, name
        assert torch.equal(our_weights[name], tensor), name

    # A drafter ModelOpt exported loads here as the one it was made from (t2d rebuilt from d2t).
    loaded, _ = export.load(tmp_path / "modelopt")
    assert loaded.layer_ids == shipped_drafter.layer_ids and loaded.left_to_target == ("embed_tokens.weight",)
    source = shipped_drafter.state_dict()
    for name, tensor in loaded.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(tensor, source[name]), name


def test_round_trip_serves_identically(llama_target, make_drafter, text_batch, tmp_path):
    from inference.engine import generate

    drafter = make_drafter(llama_target, depth=3).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)  # off their initial values
    out_dir = export.save(drafter, tmp_path / "trtllm", Verifier.of(llama_target), fmt="trtllm")
    config = json.loads((out_dir / "config.json").read_text())
    assert export.format_of(config) == "trtllm" and config["torch_dtype"] == "float32"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in LAYER_IDS]
    assert "embed_tokens.weight" not in load_file(out_dir / "model.safetensors")

    loaded, verifier = export.load(out_dir)
    assert verifier is None and loaded.layer_ids == LAYER_IDS
    export.share_target_embedding(loaded, llama_target)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in drafter.state_dict().items())
    prompt = text_batch[0, :12].tolist()
    here, there = (generate(llama_target, d, prompt, 24, k=3) for d in (drafter, loaded.eval()))
    assert here.tokens == there.tokens


def test_refuses_what_the_layout_cannot_hold(llama_target, make_drafter, tmp_path):
    for fields, match in (({"norm_before_residual": True}, "no norm_before_residual"),
                          ({"fc_norm": True, "norm_output": True}, "no fc_norm, norm_output .EAGLE-3.1.")):
        with pytest.raises(UserError, match=match):
            export.save(make_drafter(llama_target, **fields), tmp_path / "t", Verifier("v", []), fmt="trtllm")
    from speculators.medusa import MedusaConfig, MedusaDrafter

    medusa = MedusaDrafter(MedusaConfig(depth=2), llama_target.hidden_size, llama_target.vocab_size)
    with pytest.raises(UserError, match="the trtllm format holds eagle3, dflash, dspark drafters, not medusa"):
        export.save(medusa, tmp_path / "t", Verifier("v", []), fmt="trtllm")
    assert not (tmp_path / "t").exists()


def modelopt_exporter_module():
    """modelopt/torch/export/plugins/hf_spec_export.py imported on its own (it needs only torch and safetensors;
    the modelopt package's own __init__ pulls in far more)."""
    plugins = modelopt_sources() / "modelopt" / "torch" / "export" / "plugins"
    package = types.ModuleType("_modelopt_export_plugins")
    package.__path__ = [str(plugins)]
    sys.modules.setdefault("_modelopt_export_plugins", package)
    return importlib.import_module("_modelopt_export_plugins.hf_spec_export")


def modelopt_default_eagle_config() -> dict:
    path = modelopt_sources() / "modelopt" / "torch" / "speculative" / "eagle" / "default_config.py"
    spec = importlib.util.spec_from_file_location("_modelopt_default_eagle_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return copy.deepcopy(module.default_eagle_config)


def modelopt_sources() -> Path:
    """The unpacked nvidia-modelopt wheel: $MODELOPT_SOURCES, else downloaded once (pip download, no install)."""
    folder = Path(os.environ.get("MODELOPT_SOURCES") or Path.home() / ".cache" / "speculators" /
                  f"modelopt-{MODELOPT_VERSION}")
    if (folder / "modelopt").is_dir():
        return folder
    wheels = folder.with_name(folder.name + ".wheel")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", f"nvidia-modelopt=={MODELOPT_VERSION}", "--no-deps",
                        "--quiet", "-d", str(wheels)], check=True, capture_output=True, timeout=300)
        wheel = next(wheels.glob("nvidia_modelopt-*.whl"))
        zipfile.ZipFile(wheel).extractall(folder)
    except (subprocess.SubprocessError, OSError, StopIteration) as error:
        pytest.skip(f"nvidia-modelopt {MODELOPT_VERSION} is not here and could not be downloaded ({type(error).__name__}); "
                    f"set MODELOPT_SOURCES to an unpacked wheel")
    return folder


def modelopt_model(drafter, target_layers: int) -> SimpleNamespace:
    """What EagleExporter reads of a ModelOpt EAGLE-3 model holding `drafter`'s weights: state_dict() (the
    eagle module's weights under eagle_module.), eagle_config built as HFEagleModel.modify builds it from
    default_eagle_config and the drafter's architecture, and the base model's config (ours: the draft
    layer's config with the target's layer count, which it was copied from)."""
    layer = drafter.layer_cfg
    base = LlamaConfig(**(layer.to_dict() | {"num_hidden_layers": target_layers}))
    theta = layer.rope_parameters["rope_theta"]
    arch = modelopt_default_eagle_config() | {
        "hidden_act": layer.hidden_act, "torch_dtype": str(drafter.stored_dtype), "rope_theta": theta,
        "rope_scaling": dict(layer.rope_parameters), "num_hidden_layers": 1,
        "intermediate_size": layer.intermediate_size, "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads, "initializer_range": layer.initializer_range,
        "rms_norm_eps": layer.rms_norm_eps, "mlp_bias": layer.mlp_bias, "attention_bias": layer.attention_bias,
        "attention_dropout": layer.attention_dropout, "head_dim": layer.head_dim,
        "use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [k - 1 for k in drafter.layer_ids],
        "use_last_layernorm": True, "has_lm_head": True, "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "hidden_size": base.hidden_size, "vocab_size": base.vocab_size,
        "max_position_embeddings": base.max_position_embeddings}
    eagle_config = type(base).from_dict(arch)
    eagle_config.eagle_decoder_type = "llama"
    stored = getattr(torch, drafter.stored_dtype)
    weights = {f"eagle_module.{name}": t if t.dtype == torch.int64 else t.to(stored)
               for name, t in drafter.state_dict().items() if name not in ("embed_tokens.weight", "t2d")}
    return SimpleNamespace(state_dict=lambda: weights, eagle_config=eagle_config, config=base)
