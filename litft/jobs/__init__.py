"""The three jobs; each is a signature (the flags) and the few choices that set it apart."""

from litft.jobs.finetune_full import finetune_full
from litft.jobs.finetune_lora import finetune_lora
from litft.jobs.pretrain import pretrain

__all__ = ["pretrain", "finetune_full", "finetune_lora"]
