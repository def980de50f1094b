"""What a training step optimizes, as one small interface beside the loop: the loop and the strategies never ask which.

An objective says what its batches hold beside the tokens, the summed loss of a
micro-batch and what that sum is over (the normaliser the loop adds up over the
whole global batch, so the step is the same however ranks and micro-batches split
it), the figures it logs, what it needs before the first step (a reference model's
scores), and the extra forwards a step makes (for FLOPs). ``litft.objectives``
builds the one a run's ``--objective`` names.
"""

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from litft.objectives.args import ObjectiveArgs
from litft.errors import LitftError


def sums_per_sequence(values: torch.Tensor, sequence: torch.Tensor, sequences: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's sum of its tokens' ``values`` and its token count (``sequence``: each token's sequence index)."""
    zeros = values.new_zeros(sequences)
    return zeros.index_add(0, sequence, values), zeros.index_add(0, sequence, torch.ones_like(values))


class Objective:
    """The supervised default's answers; each family overrides what differs."""

    name = "sft"
    unit = "samples"  # what the data holds, on the first screen
    progress: Tuple[Tuple[str, str, str], ...] = ()  # (label, figure, format) the progress line shows beside the loss
    reference_forwards = 0  # no-grad forwards of the model per micro-batch beside the step's own (for FLOPs)
    rows_per_sample = 1  # sequences a sample holds (a preference pair: 2), for the estimate's trace
    generates = False  # whether its batches are sampled by the model as it trains (litft.rl.rollouts)
    steps_per_batch = 1  # optimizer steps on one global batch of the data (RL's iterations on a batch of rollouts)

    def __init__(self, args: ObjectiveArgs, lora: bool):
        self.args, self.lora = args, lora
        self.pending: list = []  # each micro-batch's figures since the last take, on the device
        self.maxima: list = []  # figures that are maxima, not sums (RL's largest importance ratio), since the last take

    # ------------------------------------------------------------ the data

    @classmethod
    def default_data(cls):
        """The data a fine-tuning job takes under this objective when ``--data`` is left out (None: the job's own default)."""
        return None

    @classmethod
    def check_data(cls, args: ObjectiveArgs, data) -> None:
        """Refuse, in one line, data this objective cannot train on."""
        from litft.data.preference import PreferenceData

        if isinstance(data, PreferenceData):
            raise LitftError(f"--data {type(data).__name__} holds preference pairs; choose an objective for them: --objective dpo, ipo, simpo or orpo")

    # ------------------------------------------------------------ the step

    def loss_sum(self, lm, batch: dict) -> torch.Tensor:
        """The micro-batch's summed loss; the loop scales it by the data-parallel world over the global batch's ``count``."""
        raise NotImplementedError

    def count(self, batch: dict) -> int:
        """What ``loss_sum`` is a sum over, counted by collate on the host: here, the tokens that carry loss."""
        return len(batch["targets"]["index"])

    def score(self, lm, batch: dict) -> torch.Tensor:
        """What a forward of the model as it is gives for scoring before training (``CausalLM.predict_step``)."""
        raise NotImplementedError(f"--objective {self.name} scores nothing before training")

    # ------------------------------------------------------------ what a run shows

    def take_figures(self) -> Optional[torch.Tensor]:
        """The summed figures of the micro-batches since the last take (on the device), or None; emptied."""
        if not self.pending:
            return None
        summed, self.pending = torch.stack(self.pending).sum(0), []
        return summed

    def take_maxima(self) -> Optional[torch.Tensor]:
        """The largest of each maximum figure since the last take (on the device), or None; emptied."""
        if not self.maxima:
            return None
        largest, self.maxima = torch.stack(self.maxima).max(0).values.reshape(-1), []
        return largest

    def figures(self, summed: torch.Tensor, prefix: str = "", maxima: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """The log's figures from the sum of every rank's ``take_figures`` (and the largest of their ``take_maxima``)."""
        return {}

    def validation_figures(self, val_loss: float, summed: Optional[torch.Tensor]) -> Dict[str, float]:
        """What validation logs beside ``val_loss``: the perplexity for next-token objectives."""
        import math

        return {"val_ppl": math.exp(min(val_loss, 50))}

    def step_batches(self, trainer, resumed: Optional[Path]):
        """The loop's source of step batches where the objective makes its own (RL's rollouts, continued from the checkpoint
        ``resumed``); None: the data's, as collated."""
        return None

    def window_times(self, window_s: float, batches_s: float, steps: int, tokens: int) -> Dict[str, float]:
        """Figures of the time a log window of ``steps`` steps took, ``batches_s`` of it making their batches (RL: training's
        share apart from sampling's)."""
        return {}

    def validation(self, trainer) -> Optional[Dict[str, float]]:
        """What validation logs where the objective measures it itself (RL's held-out reward); None: the loss on the data."""
        return None

    # ------------------------------------------------------------ before the first step

    def prepare(self, trainer, resumed: Optional[Path]) -> Dict[str, object]:
        """Whatever the objective needs before training (a reference's scores, read back from ``resumed`` when resuming); the
        files every checkpoint must then keep, by name."""
        return {}

    def describe(self) -> Optional[str]:
        """Where its reference comes from and what it costs (the estimate's line), where it has one."""
        return None

    def summary(self) -> Optional[str]:
        """A first-screen line about the objective, where it has something to say."""
        return None

    # ------------------------------------------------------------ the estimate

    def generation_bytes(self, config, prompt_len: int, itemsize: int, prompts: int = 1) -> int:
        """Device memory its sampling holds between steps, where it samples (RL: a generate call's KV cache and logits)."""
        return 0

    def fake_batch(self, rows: int, seq_len: int, tokens: torch.Tensor) -> dict:
        """A micro-batch of ``rows`` sequences of ``seq_len`` tokens for the estimate's trace (on fake tensors)."""
        index = torch.arange(rows * seq_len).reshape(rows, seq_len)[:, :-1].flatten()
        return {"input_ids": tokens, "labels": tokens, "position_ids": None, "targets": {"index": index, "labels": tokens.flatten()[index]}}
