"""Every family's distillation loss is selectable (drafter.loss, kernels/distill.py KINDS), and training
on the LK acceptance loss raises the acceptance it optimises."""

import sys

import pytest
import torch
from conftest import DRAFT_VOCAB

from common.config import UserError
from forge_kernels.distill import KINDS
from speculators import draft_vocab
from speculators.families import FAMILIES


def make(name: str, target, text_batch, **fields):
    cls = FAMILIES[name]
    known = cls.config_class.__dataclass_fields__
    sized = {"draft_vocab_size": DRAFT_VOCAB} if "draft_vocab_size" in known else {}
    sized |= {"depth": 3} if "depth" in known else {"block_size": 4}  # DFlash: K = B-1
    counts = draft_vocab.count_tokens(text_batch, torch.ones_like(text_batch), target.vocab_size)
    torch.manual_seed(0)
    return cls.from_target(cls.config_class(**sized, **fields), target, counts)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_trains_on_the_loss_it_is_given(name, llama_target, text_batch, monkeypatch):
    # the module whose code calls the loss: the family's own, or the one it inherits its loss from (DSpark: DFlash's)
    module = next(m for m in (sys.modules[c.__module__] for c in FAMILIES[name].__mro__) if hasattr(m, "distill_loss"))
    kinds = []

    def spy(*args, kind, **kw):
        kinds.append(kind)
        return real(*args, kind=kind, **kw)

    real = module.distill_loss
    monkeypatch.setattr(module, "distill_loss", spy)
    drafter = make(name, llama_target, text_batch, loss="lk_hybrid")
    loss, _ = drafter.training_loss(llama_target(text_batch), text_batch, torch.ones_like(text_batch))
    loss.backward()
    assert kinds and set(kinds) == {"lk_hybrid"} and torch.isfinite(loss)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_unknown_loss_is_one_line_naming_the_key(name):
    with pytest.raises(UserError, match="drafter.loss") as error:
        FAMILIES[name].config_class(loss="tv")
    assert "\n" not in str(error.value) and all(kind in str(error.value) for kind in KINDS)


def test_eagle3_on_the_lk_loss_raises_its_acceptance(llama_target, text_batch):
    """alpha = sum min(p, q) of the first draft step, over the positions it trains, rises with training."""
    drafter = make("eagle3", llama_target, text_batch, loss="lk")
    out, mask = llama_target(text_batch), torch.ones_like(text_batch)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(25):
        loss, metrics = drafter.training_loss(out, text_batch, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(metrics["loss_step0"]))
    # loss_step0 = mean -log alpha over trained positions: falling means the acceptance rises
    assert losses[-1] < 0.5 * losses[0], losses
