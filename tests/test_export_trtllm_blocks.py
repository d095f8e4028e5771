"""--format trtllm for DFlash and DSpark drafters: the folder ModelOpt 0.47's DFlashExporter / DSparkExporter
(modelopt/torch/export/plugins/hf_spec_export.py) write for the same weights, which TensorRT-LLM's DFlash /
DSpark read, and the serving YAML beside it.

ModelOpt's exporters are run here, on the CPU, from the unpacked wheel (downloaded on demand, skipped offline):
our model.safetensors is first loaded strictly into ModelOpt's own DFlashModule / DSparkModule
(modeling_dflash.py / modeling_dspark.py), so a differing weight name or shape fails there; that module's
state dict, under dflash_module., is what the exporter is given, and its config.json and model.safetensors are
compared with ours key by key, value by value, shape by shape and dtype by dtype."""

import importlib
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from conftest import DRAFT_VOCAB
from safetensors.torch import load_file
from test_export_trtllm import modelopt_exporter_module, modelopt_sources
from transformers import AutoConfig, Qwen3Config

from common.config import UserError
from speculators import draft_vocab, export
from speculators.dflash import DFlashConfig, DFlashDrafter
from speculators.dspark import DSparkConfig, DSparkDrafter
from speculators.export import Verifier
from speculators.formats import trtllm as export_trtllm
from speculators.layers import layer_config
from speculators.mask_token import with_mask_token

LAYER_IDS = [1, 2, 3]  # ours (HF hidden_states[k]); TensorRT-LLM's "output of layer k - 1": [0, 1, 2]


def make_block_drafter(family, target, text_batch, **fields):
    """A drafter of `family` off its initial values, its mask embedding the target's row (as TensorRT-LLM's)."""
    torch.manual_seed(0)
    cls, config_class = (DSparkDrafter, DSparkConfig) if family == "dspark" else (DFlashDrafter, DFlashConfig)
    extra = {"markov_rank": 16} if family == "dspark" else {}
    counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
    cfg = with_mask_token(config_class(block_size=4, draft_vocab_size=DRAFT_VOCAB, **extra, **fields), counts)
    layer_cfg = layer_config(target)
    layer_cfg.num_hidden_layers = cfg.num_layers
    drafter = cls(cfg, layer_cfg, LAYER_IDS, target.hidden_size)
    drafter.start_from_target(target, counts, cfg.draft_vocab_size)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.requires_grad and name != "mask_embedding":
                p.add_(torch.randn_like(p) * 0.05)
    drafter.reset_mask_embedding()
    return drafter


def modelopt_plugin(name: str):
    """modelopt/torch/speculative/plugins/<name>.py imported on its own (it needs torch and transformers)."""
    plugins = modelopt_sources() / "modelopt" / "torch" / "speculative" / "plugins"
    package = types.ModuleType("_modelopt_spec_plugins")
    package.__path__ = [str(plugins)]
    sys.modules.setdefault("_modelopt_spec_plugins", package)
    return importlib.import_module(f"_modelopt_spec_plugins.{name}")


def modelopt_export(drafter, our_weights: dict, target_dir, out):
    """ModelOpt's module built for this drafter, loaded strictly with our weights, exported by its exporter."""
    layer = drafter.layer_cfg
    draft_config = Qwen3Config(hidden_size=layer.hidden_size, num_hidden_layers=len(drafter.layers),
                               num_attention_heads=layer.num_attention_heads,
                               num_key_value_heads=layer.num_key_value_heads, head_dim=layer.head_dim,
                               intermediate_size=layer.intermediate_size, rms_norm_eps=layer.rms_norm_eps,
                               vocab_size=len(drafter.t2d), hidden_act=layer.hidden_act)
    draft_config.block_size = drafter.cfg.block_size
    draft_config.target_layer_ids = [k - 1 for k in drafter.layer_ids]
    if drafter.family == "dspark":
        draft_config.markov_rank, draft_config.markov_head_type = drafter.cfg.markov_rank, drafter.cfg.markov_head_type
        draft_config.use_confidence_head = True
        module = modelopt_plugin("modeling_dspark").DSparkModule(draft_config)
    else:
        module = modelopt_plugin("modeling_dflash").DFlashModule(draft_config)
    module.load_state_dict(our_weights, strict=True)  # a differing name or shape fails here
    weights = {f"dflash_module.{name}": t for name, t in module.state_dict().items()}
    model = SimpleNamespace(state_dict=lambda: weights, config=AutoConfig.from_pretrained(target_dir),
                            dflash_config=draft_config, dflash_block_size=drafter.cfg.block_size,
                            mask_token_id=drafter.cfg.mask_token_id, target_layer_ids=draft_config.target_layer_ids)
    exporter = modelopt_exporter_module()
    cls = exporter.DSparkExporter if drafter.family == "dspark" else exporter.DFlashExporter
    cls(model).export(out)
    return out


@pytest.mark.parametrize("family, fields", [("dflash", {}), ("dspark", {"markov_head_type": "vanilla"}),
                                            ("dspark", {"markov_head_type": "gated"}),
                                            ("dspark", {"markov_head_type": "rnn"})])
def test_block_drafter_equals_modelopts_export_of_the_same_weights(family, fields, llama_target, llama_dir,
                                                                     text_batch, tmp_path):
    drafter = make_block_drafter(family, llama_target, text_batch, **fields)
    ours = export.save(drafter, tmp_path / "ours", Verifier(str(llama_dir), ["LlamaForCausalLM"]), fmt="trtllm")
    our_weights = load_file(ours / "model.safetensors")
    theirs = modelopt_export(drafter, our_weights, llama_dir, tmp_path / "modelopt")
    config, their_config = (json.loads((d / "config.json").read_text()) for d in (ours, theirs))
    assert list(config) == list(their_config)
    for key, value in their_config.items():
        assert config[key] == value, key
    assert config["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert config["dflash_config"]["mask_token_id"] == drafter.cfg.mask_token_id
    their_weights = load_file(theirs / "model.safetensors")
    assert sorted(our_weights) == sorted(their_weights)
    for name, tensor in their_weights.items():
        assert our_weights[name].shape == tensor.shape and our_weights[name].dtype == tensor.dtype, name
        assert torch.equal(our_weights[name], tensor), name

    # Our weights under ModelOpt's names, the Markov W2 spread over the target's vocabulary.
    source = drafter.state_dict()
    assert torch.equal(our_weights["fc.weight"], source["fc.weight"])
    if family == "dspark":
        w2 = our_weights["markov_w2.weight"]
        assert torch.equal(w2[drafter.draft_to_target], source["markov_head.markov_w2.weight"])
        assert int(w2.abs().sum(1).ne(0).sum()) == DRAFT_VOCAB
        assert torch.equal(our_weights["confidence_proj.weight"], source["confidence_head.proj.weight"])


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_serving_yaml_names_the_block_and_its_layers(family, llama_target, llama_dir, text_batch, tmp_path):
    drafter = make_block_drafter(family, llama_target, text_batch)
    out = export.save(drafter, tmp_path / "t", Verifier(str(llama_dir), []), fmt="trtllm")
    lines = [line for line in (out / export_trtllm.SERVING_FILE).read_text().splitlines() if not line.startswith("#")]
    assert lines == ["speculative_config:", f"  decoding_type: {export_trtllm.BLOCK_FAMILIES[family]}",
                     f"  max_draft_len: {drafter.k}", f"  speculative_model: {json.dumps(str(out.resolve()))}",
                     f"  mask_token_id: {drafter.cfg.mask_token_id}", "  target_layer_ids: [0, 1, 2]"]


def test_dspark_serving_yaml_names_the_confidence_files_beside_the_source(llama_target, llama_dir, text_batch,
                                                                          tmp_path):
    drafter = make_block_drafter("dspark", llama_target, text_batch)
    source = export.save(drafter, tmp_path / "source", Verifier(str(llama_dir), []))
    (source / "sts.json").write_text(json.dumps({"sts_temperatures": [1.0, 1.1, 1.2, 1.3]}))
    (source / "sps.json").write_text(json.dumps({"step_time_ms": [10.0, 11.0]}))
    out = export.convert(source, tmp_path / "trt", "trtllm")
    text = (out / export_trtllm.SERVING_FILE).read_text()
    assert "  enable_confidence_scheduling: true\n" in text
    assert f"  confidence_sts_path: {json.dumps(str((out / 'sts.json').resolve()))}\n" in text
    assert f"  confidence_sps_table_path: {json.dumps(str((out / 'sps.json').resolve()))}\n" in text
    assert (out / "sts.json").read_text() == (source / "sts.json").read_text()
    assert (out / "sps.json").read_text() == (source / "sps.json").read_text()


def test_refuses_what_trtllm_would_serve_differently(llama_target, llama_dir, text_batch, tmp_path):
    verifier = Verifier(str(llama_dir), [])
    drafter = make_block_drafter("dflash", llama_target, text_batch)
    with torch.no_grad():
        drafter.mask_embedding.add_(0.1)
    with pytest.raises(UserError, match="embeds the mask token with the target's row"):
        export.save(drafter, tmp_path / "t", verifier, fmt="trtllm")
    drafter = make_block_drafter("dspark", llama_target, text_batch, confidence_with_markov=False)
    with pytest.raises(UserError, match="confidence_with_markov=false"):
        export.save(drafter, tmp_path / "t", verifier, fmt="trtllm")
    drafter = make_block_drafter("dflash", llama_target, text_batch)
    drafter.layer_ids = [0, 1, 2]
    with pytest.raises(UserError, match="layer id 0"):
        export.save(drafter, tmp_path / "t", verifier, fmt="trtllm")
    assert not (tmp_path / "t").exists()


def test_a_dflash_export_loads_back_as_the_full_vocabulary_drafter_it_drafts_as(llama_target, llama_dir, text_batch,
                                                                               tmp_path):
    """ModelOpt's DFlash layout is the original DFlash one (architectures DFlashDraftModel): it reads back through
    the dflash format, over the target's whole vocabulary, the mask row and lm_head the target's."""
    drafter = make_block_drafter("dflash", llama_target, text_batch)
    out = export.save(drafter, tmp_path / "t", Verifier(str(llama_dir), []), fmt="trtllm")
    loaded, _ = export.load(out)
    assert isinstance(loaded, DFlashDrafter) and loaded.layer_ids == LAYER_IDS
    assert loaded.cfg.mask_token_id == drafter.cfg.mask_token_id and loaded.cfg.block_size == drafter.cfg.block_size
    export.share_target_embedding(loaded, llama_target)
    state, source = loaded.state_dict(), drafter.state_dict()
    for name, tensor in source.items():
        if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            assert torch.equal(state[name], tensor), name
