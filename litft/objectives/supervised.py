"""Supervised fine-tuning and pretraining: the summed cross-entropy of the tokens that carry loss (the default)."""

import torch
import torch.nn.functional as F

from litft.data.collate import targets_of
from litft.objectives.base import Objective


class Supervised(Objective):
    """Next-token cross-entropy on target tokens, by the fused head where it can (litft.model.loss), over the tokens of the batch."""

    def loss_sum(self, lm, batch: dict) -> torch.Tensor:
        targets = batch.get("targets") or targets_of(batch["labels"])
        loss, aux, fused = lm.head_forward(batch, targets, per_token=False)
        if not fused:
            picked = loss.reshape(-1, loss.shape[-1]).index_select(0, targets["index"])
            loss = F.cross_entropy(picked.float(), targets["labels"], reduction="sum")
        return lm.with_router_aux(loss, aux, len(targets["index"]))
