"""One LightningModule for every drafter family: the frozen target in, the family's loss out.

A family (speculators/<family>.py) provides `from_target(cfg, target, token_counts)` and
`training_loss(target_out, input_ids, loss_mask) -> (loss, metrics)`; nothing here knows
which family it trains. The target is held as a plain attribute, not a submodule, so its
weights never reach the optimizer or a checkpoint; nor do the drafter's frozen copies of them (its
embedding, a frozen lm_head), which a resumed run rebuilds from the target as a new run does. With
data.hidden_states=cache, batches carry the target's hidden states and the target (loaded without its
decoder layers) only applies its lm_head.

Under trainer=fsdp (FSDP2, Lightning's ModelParallelStrategy) configure_model shards the
drafter's weights, gradients and optimizer state across the processes. FSDP2 gathers the
weights around forward(); a family trains through `training_loss`, registered here as one
more forward method, and serves through `unsharded`.
"""

import contextlib
from collections.abc import Callable

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from common.config import UserError
from speculators.target import FrozenTarget, TargetOutput
from train.optim import OptimConfig, check_finite, configure


class DrafterModule(L.LightningModule):
    def __init__(self, drafter: torch.nn.Module, target: FrozenTarget, optim: OptimConfig, max_steps: int):
        super().__init__()
        self.drafter, self.target = drafter, target
        self.optim, self.max_steps = optim, max_steps
        self.strict_loading = False  # checkpoints leave the frozen weights out (on_load_checkpoint checks the rest)

    def configure_model(self) -> None:
        if self.device_mesh is None or isinstance(self.drafter, FSDPModule):  # not FSDP, or sharded already
            return
        fully_shard(self.drafter, mesh=self.device_mesh["data_parallel"])
        register_fsdp_forward_method(self.drafter, "training_loss")

    def on_fit_start(self) -> None:
        self.target.to(self.device)

    def target_outputs(self, batch: dict) -> TargetOutput:
        # The teacher is the target as served: under trainer.precision=bf16-mixed only the drafter is autocast.
        with torch.autocast(self.device.type, enabled=False):
            if "last_hidden" in batch:  # data.hidden_states=cache: the target's lm_head turns them into logits
                return self.target.from_hidden(list(batch["aux_hidden"].unbind(1)), batch["last_hidden"], batch.get("greedy"))
            return self.target(batch["input_ids"])

    def step(self, batch: dict, stage: str) -> torch.Tensor:
        loss, metrics = self.drafter.training_loss(self.target_outputs(batch), batch["input_ids"], batch["loss_mask"])
        self.log(f"{stage}/loss", loss, prog_bar=True)
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value, prog_bar=name == "acc_step0")
        return loss

    def training_step(self, batch: dict, _) -> torch.Tensor:
        loss = self.step(batch, "train")
        check_finite(loss, self.global_step + 1, self.trainer.default_root_dir)
        return loss

    def validation_step(self, batch: dict, _) -> None:
        self.step(batch, "val")

    def configure_optimizers(self):
        return configure(list(self.drafter.parameters()), self.optim, self.max_steps)

    def frozen_names(self) -> set[str]:
        return {name for name, p in self.named_parameters() if not p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Leave out the target's weights the drafter holds frozen (an 8B target's embedding is 2 GB a checkpoint
        in fp32), and key the optimizer state by each parameter's place in self.parameters(), as Lightning's fsdp
        saves it, not by its place in the optimizer's groups (frozen embeddings left out, matrices first):
        Lightning reads a whole checkpoint's keys that way when a run resumes under fsdp. Loading without fsdp
        pairs them by their order in the groups, which this keeps."""
        if isinstance(self.drafter, FSDPModule):  # saved by Lightning's fsdp, keyed that way already
            return
        for name in self.frozen_names():
            checkpoint["state_dict"].pop(name, None)
        place = {id(p): i for i, p in enumerate(self.parameters())}
        for optimizer, state in zip(self.trainer.optimizers, checkpoint.get("optimizer_states", [])):
            key = {i: place[id(p)] for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
            state["state"] = {key[i]: value for i, value in state["state"].items()}
            for group in state["param_groups"]:
                group["params"] = [key[i] for i in group["params"]]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Loading is not strict (the frozen weights a checkpoint leaves out stay as this module was built: resume=
        refuses a changed target or data, train/run.py), so any other difference is refused here. Under fsdp a
        whole checkpoint loads before this hook, without the check."""
        if "state_dict" not in checkpoint:
            return
        own, saved = set(self.state_dict()), set(checkpoint["state_dict"])
        missing, unexpected = own - self.frozen_names() - saved, saved - own
        if missing or unexpected:
            raise UserError(f"the checkpoint's drafter is not this run's: missing {sorted(missing)[:3]}, unexpected "
                            f"{sorted(unexpected)[:3]}")


@contextlib.contextmanager
def unsharded(drafter: torch.nn.Module):
    """The whole drafter on this process, to serve it between steps. Under FSDP2 every process
    must enter (gathering the shards is collective); otherwise it changes nothing."""
    if not isinstance(drafter, FSDPModule):
        yield drafter
        return
    drafter.unshard()
    try:
        yield drafter
    finally:
        drafter.reshard()


def plain_copy(drafter: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """The trained weights of an FSDP2-sharded drafter in a new, unsharded one from `build()`, on
    process 0, to export and serve; None on the others (a collective: every process calls it).
    Without FSDP, the drafter itself."""
    if not isinstance(drafter, FSDPModule):
        return drafter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() != 0:
        return None
    fresh = build()
    fresh.load_state_dict(state)
    return fresh
