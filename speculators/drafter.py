"""The drafter contract: what every family implements (speculators/eagle3.py, eagle.py, peagle.py,
medusa.py, dflash.py) and all that training (train/module.py), serving (inference/drafting.py, inference/engine.py)
and export (speculators/export.py) may read.

A family is one file: a subclass of ChainDrafter, ParallelDrafter or HeadsDrafter (how it is served) whose
class attribute `family` names it, which registers it (FAMILIES), and one recipe in conf/conf/ whose
drafter.family is that name. The family's name is also the module that defines it: speculators/<family>.py,
or a module of your own on the Python path (speculators.families imports it on first use). A class that
leaves out a method its kind needs cannot be built (TypeError naming the method).
"""

from abc import ABCMeta, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from common.config import UserError
from speculators import draft_vocab
from speculators.layers import KVCache, LayerCaches
from speculators.target import FrozenTarget, TargetOutput

FAMILIES: dict[str, type["Drafter"]] = {}  # family name -> class, filled as family classes are defined


class Drafter(nn.Module, metaclass=ABCMeta):
    family: ClassVar[str]  # the recipe's drafter.family: defining a class with it registers the family
    config_class: type  # the family's config dataclass (the recipe's drafter.* keys); it has depth
    export_formats: tuple[str, ...]  # speculators.export's FORMATS that hold it; the first is written by default
    drafting_kind: str  # how inference.drafting serves it: autoregressive | parallel | heads (the base class sets it)
    drafts_beyond_depth: bool = True  # a K above its depth is served (untrained positions); False: refused
    layer_ids: list[int] = []  # target layers whose hidden states it reads; [] (EAGLE-1, Medusa): the last one only
    left_to_target: tuple[str, ...] = ()  # weights its export left to the target: export.share_target_embedding fills them
    cfg: object  # an instance of config_class
    d2t: torch.Tensor  # draft id -> target id offset [N] (speculators/draft_vocab.py)
    t2d: torch.Tensor  # target id -> in the draft vocabulary [V]
    best_k: int | None = None  # the K measured fastest (export.set_best_k); None: not measured, serve its depth
    calibration_file = None  # an export's sts.json (inference/calibration.py), which drafting.plan reads

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            FAMILIES[cls.family] = cls

    @property
    def export_format(self) -> str:
        return self.export_formats[0]

    @classmethod
    @abstractmethod
    def from_target(cls, cfg, target: FrozenTarget, token_counts: torch.Tensor) -> "Drafter":
        """A new drafter for `target`; token_counts [V] (training tokens) choose a draft vocabulary."""

    @abstractmethod
    def training_loss(self, target_out: TargetOutput, input_ids: torch.Tensor,
                      loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, metrics with acc_step{j} for every draft position j) of a batch, given the target's outputs."""

    @property
    @abstractmethod
    def target_hidden_size(self) -> int:
        """The width of the target's hidden states it reads."""

    @classmethod
    def from_speculators_config(cls, config: dict, layer_cfg) -> "Drafter":
        """An empty drafter shaped by a speculators-format config.json (families in that format)."""
        raise UserError(f"{cls.family} drafters are not written in the speculators format")

    def speculators_extra_config(self) -> dict:
        """A family exported in the speculators format: its own config.json keys (speculators/export.py
        writes the shared ones)."""
        raise UserError(f"{self.family} drafters are not written in the speculators format")

    def check(self, target: FrozenTarget) -> list[str]:
        """What keeps this drafter from serving `target` (inference/engine.py check_pair)."""
        problems = []
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"hidden size {self.target_hidden_size} (drafter) vs {target.hidden_size} (target)")
        if len(self.t2d) != target.vocab_size:
            problems.append(f"vocabulary size {len(self.t2d)} (drafter) vs {target.vocab_size} (target)")
        if len(self.d2t) != self.lm_head.out_features:
            problems.append(f"d2t length {len(self.d2t)} vs the drafter's {self.lm_head.out_features} draft tokens")
        if max(self.layer_ids or [0]) >= target.num_layers:
            problems.append(f"feature layer ids {self.layer_ids} (drafter) vs a target of {target.num_layers} layers")
        served = getattr(target, "layer_ids", None)  # a TargetShape, read before loading, serves none yet
        if self.layer_ids and served is not None and list(served) != list(self.layer_ids):
            problems.append(f"it reads target layers {self.layer_ids}; the target was loaded to serve {list(served)}")
        return problems

    def add_target_parts(self, cfg, layer_cfg, layer_ids: list[int]) -> tuple[int, int]:
        """What the families reading target layers build first (EAGLE-3, P-EAGLE, DFlash): their configs, the
        target's embeddings (frozen) and the draft vocabulary maps. Returns (hidden size, draft vocabulary size)."""
        self.cfg, self.layer_cfg, self.layer_ids = cfg, layer_cfg, list(layer_ids)
        H, V, N = layer_cfg.hidden_size, layer_cfg.vocab_size, cfg.draft_vocab_size
        if N > V:
            raise UserError(f"draft_vocab_size={N} is larger than the target's vocabulary ({V})")
        self.embed_tokens = nn.Embedding(V, H).requires_grad_(False)  # the target's, frozen
        self.register_buffer("d2t", torch.zeros(N, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool))
        return H, N

    @torch.no_grad()
    def start_from_target(self, target: FrozenTarget, token_counts: torch.Tensor, draft_vocab_size: int) -> None:
        """A draft vocabulary of the training tokens; the target's embeddings and its lm_head rows of that
        vocabulary as the drafter's (families with `embed_tokens` and a draft-vocabulary `lm_head`)."""
        self.d2t, self.t2d = draft_vocab.build(token_counts, draft_vocab_size)
        self.embed_tokens.weight.copy_(target.embedding_weight().float())
        self.lm_head.weight.copy_(target.lm_head_weight()[self.draft_to_target].float())

    @property
    def embedding_from_target(self) -> bool:
        """Loaded from an export without embed_tokens (the target's, not yet shared)."""
        return "embed_tokens.weight" in self.left_to_target

    @property
    def depth(self) -> int:
        """The draft positions it was trained to propose (training-time-test steps, heads, tokens per pass)."""
        return self.cfg.depth

    @property
    def k(self) -> int:
        """K served unless told otherwise: the fastest its closing report or card measured (an export's
        speculative_tokens), else its depth."""
        return self.best_k or self.depth

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token ids of the draft vocabulary, in draft-id order."""
        return draft_vocab.target_ids(self.d2t)


class CachedDrafter(Drafter):
    """A drafter that reads the verified positions' features into a cache of its own while serving."""

    @abstractmethod
    def new_cache(self, batch: int, max_len: int, device=None) -> KVCache | LayerCaches:
        """An empty serving cache (anything with `length` and `crop(length)`)."""

    @abstractmethod
    def features(self, target_out: TargetOutput) -> torch.Tensor:
        """Hidden inputs [B, m, H] of verified positions, from the target's outputs."""


class ChainDrafter(CachedDrafter):
    """Served one step per draft token (inference.drafting's chain and tree proposers): EAGLE-1, EAGLE-3."""

    drafting_kind = "autoregressive"

    @abstractmethod
    def step(self, cache, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
             visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-vocab logits, output hidden states) of m positions appended after `cache`: tokens [B, m] and
        hidden inputs [B, m, H] (`features` of verified positions, or its own previous output while drafting).
        Positions default to the next m and attention to causal; a tree draft passes its nodes' positions and
        `visible` [m, cache.length + m]. `cache.crop` undoes it."""


class ParallelDrafter(CachedDrafter):
    """All K drafts from one drafter pass (inference.drafting.ParallelProposer): P-EAGLE, DFlash."""

    drafting_kind = "parallel"

    @abstractmethod
    def draft(self, cache, tokens: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Append m verified positions (tokens [1, m], `features` [1, m, H]) to the cache and return draft-vocab
        logits [k, N] of the next k tokens, from one pass."""


class HeadsDrafter(Drafter):
    """All drafts from heads on the target's last verified state (inference.drafting): Medusa."""

    drafting_kind = "heads"

    @abstractmethod
    def head_logits(self, last_hidden: torch.Tensor, heads: range | None = None) -> torch.Tensor:
        """[B, len(heads), V]: the logits of `heads` (all by default) at one position per row, last_hidden [B, H]."""


def eagle3_layout_keys(drafter: Drafter) -> dict:
    """The speculators config keys of the EAGLE-3 layout (EAGLE-3 and P-EAGLE); EAGLE-3.1 flags off."""
    return {"target_hidden_size": drafter.target_hidden_size, "eagle_aux_hidden_state_layer_ids": drafter.layer_ids,
            "norm_before_residual": drafter.cfg.norm_before_residual,  # vLLM assumes true when absent
            "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def speculators_depth(config: dict) -> int:
    """The trained depth a speculators-format config.json records (its speculative_tokens where it does not:
    exports of other trainers, which serve what they trained)."""
    return config.get("trained_depth") or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
