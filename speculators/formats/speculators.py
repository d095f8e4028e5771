"""The speculators format (vLLM): EAGLE-3, P-EAGLE, DFlash and DSpark, each family adding its own keys to the
shared ones (`speculators_extra_config`); weights keep the drafter's own names (fc, layers.N.*, norm, lm_head,
embed_tokens) plus the draft-vocab maps d2t (int64 [N]) and t2d (bool [V]). An export without valid maps is
refused: it would load in vLLM and accept almost nothing. A family's speculators_model_type is its name."""

from transformers import LlamaConfig

from common.config import UserError
from speculators import draft_vocab
from speculators.formats import Format, Verifier, families_of, register_format

SPECULATORS_VERSION = "0.3.0"
# vLLM's class names of the speculators families it serves; a family of your own records its class's name.
SPECULATORS_ARCHITECTURES = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleSpeculator", "dflash": "DFlashSpeculator"}


def speculators_config(drafter, verifier: Verifier) -> dict:
    layer = drafter.layer_cfg.to_dict()
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=len(drafter.layers),
                 vocab_size=len(drafter.t2d))
    kind = drafter.family
    return {
        "architectures": [SPECULATORS_ARCHITECTURES.get(kind, type(drafter).__name__)],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": verifier.architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": drafter.cfg.draft_vocab_size,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "trained_depth": drafter.depth,  # this project's key: speculative_tokens is the K to serve
    } | drafter.speculators_extra_config()


def write(drafter, verifier: Verifier) -> tuple[dict, dict]:
    draft_vocab.check(drafter.d2t, drafter.t2d, len(drafter.t2d), drafter.cfg.draft_vocab_size)
    return speculators_config(drafter, verifier), drafter.state_dict()


def read(config: dict, weights: dict):
    kind = config.get("speculators_model_type")
    if not isinstance(kind, str) or "speculators" not in family_class(kind).export_formats:
        raise UserError(f"speculators_model_type {kind!r} is not supported here; "
                        f"supported: {', '.join(families_of('speculators'))}")
    layer_cfg = LlamaConfig(**{k: v for k, v in config["transformer_layer_config"].items()
                               if k not in ("architectures", "model_type", "dtype")})
    draft_vocab.check(weights.get("d2t"), weights.get("t2d"), layer_cfg.vocab_size, config["draft_vocab_size"])
    drafter = family_class(kind).from_speculators_config(config, layer_cfg)
    drafter.best_k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    return drafter, weights


def family_class(name: str) -> type:
    """The class of family `name`, read from a speculators export (an unknown name: one line)."""
    from speculators.families import family

    try:
        return family(name)
    except UserError:
        raise UserError(f"a speculators export of a drafter family {name!r} this installation does not have; "
                        f"known: {', '.join(families_of('speculators'))}") from None


# speculators' own DFlash and DSpark checkpoints leave out embed_tokens, their mask token's row included (frozen
# there): both are the target's, as vLLM serves them.
register_format(Format("speculators", write, read,
                       lambda config: config["speculators_config"]["verifier"]["name_or_path"],
                       lambda config: "speculators_model_type" in config,
                       left_to_target=("embed_tokens.weight", "mask_embedding")))
