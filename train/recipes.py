"""The recipes `python train.py conf=<recipe>` runs, as typed configs: every key of the composed
Hydra config lands in one of these dataclasses (common/config.py's to_dataclass).

- drafter (conf=eagle3, ...): distil a drafter from a frozen target, then export it (train/distill.py);
- pretrain (conf=target_pretrain): pretrain the shipped default target (train/pretrain.py).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common import corpus
from common.config import UserError, at_least, one_of, require
from common.tracking import LoggerConfig
from inference.evalsets import EvalConfig
from speculators.quant import QuantConfig
from speculators.target import TargetConfig
from train.callbacks import ServeEvalConfig
from train.data import DataConfig
from train.optim import OptimConfig

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu")
PRECISIONS = ("auto", "32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
# ddp: one process per device, gradients all-reduced (gloo on CPU, nccl on GPU); fsdp: the same
# processes, each holding a shard of the drafter's weights, gradients and optimizer state (FSDP2)
STRATEGIES = ("auto", "ddp", "fsdp")
ALL_DEVICES = -1  # trainer.devices: every visible GPU, as Lightning reads -1


@dataclass
class TrainerConfig:
    """Lightning Trainer settings (the `trainer` config group)."""

    max_steps: int = 500
    accelerator: str = "cpu"
    devices: int = 1  # per node; -1: every visible GPU (not with accelerator=cpu, whose devices are processes)
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "32-true"  # auto: bf16-mixed where bf16 arithmetic is native (a GPU; AMX or AVX-512 BF16 CPUs)
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    log_every_n_steps: int = 10
    val_every_n_steps: int = 100
    checkpoint_every_n_steps: int = 100
    progress_bar: bool = True  # a bar on a terminal; false, or output to a file: a line every log_every_n_steps
    # (step, loss, s/step, time left) instead, since a redirected bar shows nothing until it ends

    def __post_init__(self):
        one_of("trainer.accelerator", self.accelerator, ACCELERATORS)
        one_of("trainer.precision", self.precision, PRECISIONS)
        one_of("trainer.strategy", self.strategy, STRATEGIES)
        require(self.devices >= 1 or (self.devices == ALL_DEVICES and self.accelerator != "cpu"), "trainer.devices",
                self.devices, f">= 1, or {ALL_DEVICES} (every visible GPU) with a GPU trainer.accelerator")
        at_least(1, trainer__max_steps=self.max_steps, trainer__num_nodes=self.num_nodes,
                 trainer__accumulate_grad_batches=self.accumulate_grad_batches,
                 trainer__log_every_n_steps=self.log_every_n_steps, trainer__val_every_n_steps=self.val_every_n_steps,
                 trainer__checkpoint_every_n_steps=self.checkpoint_every_n_steps)
        at_least(0, trainer__gradient_clip_val=self.gradient_clip_val)
        if self.num_threads is not None:
            at_least(1, trainer__num_threads=self.num_threads)

    def resolved_precision(self) -> str:
        """trainer.precision, `auto` decided for this machine: bf16 autocast pays only where bf16 matmuls are
        native; elsewhere (an AVX2 CPU) they run several times slower than fp32."""
        if self.precision != "auto":
            return self.precision
        on_gpu = self.accelerator != "cpu" and torch.cuda.is_available()
        return "bf16-mixed" if on_gpu or native_cpu_bf16() else "32-true"


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX-512 BF16)."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


@dataclass
class ModelConfig:
    """The target's Llama architecture (fields of transformers' LlamaConfig)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def __post_init__(self):
        at_least(1, model__hidden_size=self.hidden_size, model__intermediate_size=self.intermediate_size,
                 model__num_hidden_layers=self.num_hidden_layers, model__num_attention_heads=self.num_attention_heads,
                 model__num_key_value_heads=self.num_key_value_heads)
        at_least(258, model__vocab_size=self.vocab_size)  # 256 bytes + EOS + at least one merge
        require(self.hidden_size % self.num_attention_heads == 0, "model.num_attention_heads",
                self.num_attention_heads, f"a divisor of model.hidden_size ({self.hidden_size})")
        require(self.num_attention_heads % self.num_key_value_heads == 0, "model.num_key_value_heads",
                self.num_key_value_heads, f"a divisor of model.num_attention_heads ({self.num_attention_heads})")


@dataclass
class UnlikelihoodConfig:
    """Sequence-level unlikelihood training (Welleck et al., 2020, "Neural Text Generation with
    Unlikelihood Training"). Greedy decoding of a small LM falls into loops ("import sys" forever);
    every `every_n_steps`-th step the model instead continues the first `prefix_len` tokens of its
    batch greedily for `continuation_len` tokens and is penalised, -log(1 - p), for each token of
    its continuation inside an n-gram that already occurred in it. The other steps keep the
    next-token loss, which holds the distribution in place."""

    every_n_steps: int = 0  # 0: plain pretraining; 2: every other step is an unlikelihood step
    prefix_len: int = 50
    continuation_len: int = 100  # also the length of the validation's greedy continuations
    ngram: int = 4

    def __post_init__(self):
        at_least(0, unlikelihood__every_n_steps=self.every_n_steps)
        at_least(1, unlikelihood__prefix_len=self.prefix_len, unlikelihood__continuation_len=self.continuation_len)
        at_least(2, unlikelihood__ngram=self.ngram)


@dataclass
class RunKeys:
    """The top-level keys of conf/config.yaml, shared by every recipe."""

    recipe: str
    seed: int
    resume: str | None
    init_from: str | None  # a saved result (pretrain: a target folder; drafter: an export) whose weights this run continues
    overwrite: bool  # replace the run's result (export/, model/) if the run directory already has one, or data.cache_dir

    def __post_init__(self):
        require(0 <= self.seed < 2**32, "seed", self.seed, "in [0, 2**32 - 1] (NumPy's seed range)")
        checkpoint_to_resume(self.resume)  # a mistyped path fails now, not after the target has loaded
        require(self.init_from is None or Path(self.init_from).is_dir(), "init_from", self.init_from,
                "an existing folder: a drafter export, or a saved target for pretraining")


@dataclass
class PretrainRecipe(RunKeys):
    data: DataConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    optim: OptimConfig
    model: ModelConfig
    unlikelihood: UnlikelihoodConfig


@dataclass
class DrafterRecipe(RunKeys):
    target: TargetConfig
    data: DataConfig
    quant: QuantConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    optim: OptimConfig
    serve_eval: ServeEvalConfig
    eval: EvalConfig  # the closing acceptance report's prompts (eval.name=data: the run's own held-out split)
    drafter: Any  # the family's own config dataclass, chosen by drafter.family

    def __post_init__(self):
        super().__post_init__()
        # A drafter learns what its target says about its data: Python source suits only a target pretrained
        # on it. Refused before anything loads, so a chat model never trains on the toy's corpus unnoticed.
        if self.data.source == "stdlib" and not corpus.pretrained_on_stdlib(self.target.name_or_path):
            raise UserError(f"data=stdlib is the pycode toy's corpus (Python source, for targets pretrained on it: "
                            f"models/pycode, conf=target_pretrain), and target {self.target.name!r} was not; pass "
                            f"chat data: data=sharegpt, or data=messages data.path=<chats.jsonl>")


RECIPES: dict[str, Any] = {"drafter": DrafterRecipe, "pretrain": PretrainRecipe}
RESULTS = {"drafter": "export", "pretrain": "model"}  # the folder each recipe writes into its run directory last


def checkpoint_to_resume(resume: str | None) -> str | None:
    """`resume` is a checkpoint file or a run directory (its checkpoints/last.ckpt)."""
    if resume is None:
        return None
    path = Path(resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise UserError(f"resume={resume}: no checkpoint at {path}")
    return str(path)
