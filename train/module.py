"""One LightningModule for every drafter family: the frozen target in, the family's loss out.

A family (speculators/<family>.py) provides `from_target(cfg, target, token_counts)` and
`training_loss(target_out, input_ids, loss_mask) -> (loss, metrics)`; nothing here knows
which family it trains. The target is held as a plain attribute, not a submodule, so its
weights never reach the optimizer or a checkpoint. With data.hidden_states=cache, batches
carry the target's hidden states and the target (loaded without its decoder layers) only
applies its lm_head.
"""

import lightning as L
import torch

from speculators.target import FrozenTarget, TargetOutput
from train.optim import OptimConfig, check_finite, configure


class DrafterModule(L.LightningModule):
    def __init__(self, drafter: torch.nn.Module, target: FrozenTarget, optim: OptimConfig, max_steps: int):
        super().__init__()
        self.drafter, self.target = drafter, target
        self.optim, self.max_steps = optim, max_steps

    def on_fit_start(self) -> None:
        self.target.to(self.device)

    def target_outputs(self, batch: dict) -> TargetOutput:
        if "last_hidden" in batch:  # data.hidden_states=cache: the target's lm_head turns them into logits
            return self.target.from_hidden(list(batch["aux_hidden"].unbind(1)), batch["last_hidden"])
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
