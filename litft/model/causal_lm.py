"""The module around a Hugging Face causal LM that litft trains: its step methods route through the wrapped forward, the
objective gives the loss, and the head computes the target tokens' loss or log-probs where it can."""

import contextlib
import math
from typing import Optional, Tuple

import torch

from litft.model.attention import PACKED_SAFE, SEGMENTS, packed_rows_known
from litft.config import TrainArgs
from litft.errors import LitftError
from litft.model.experts import counting_only
from litft.model.recurrent import carries_state
from litft.model.loss import fused_head
from litft.model.offload import ActivationOffload
from litft.model.vision import answer_as_transformers_expects, has_pixels, sees_images
from litft.model.weights import transformer_blocks


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine down to ``min_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class CausalLM(torch.nn.Module):
    """A Hugging Face causal LM as litft trains it.

    Fabric routes ``training_step`` and ``validation_step`` through the wrapped module's
    forward, so DDP, FSDP and DeepSpeed hooks run when the loop calls them.

    The step methods return the objective's *sum* (of token losses, of pair losses); the
    loop divides by what it sums over in the whole global batch (``objective.count``),
    so a step's gradient is the same however the batch is split over ranks and micro-batches.
    """

    def __init__(self, model: torch.nn.Module, train: TrainArgs, objective, total_steps: int = 1):
        super().__init__()
        self.model = model
        self.train_args = train
        self.total_steps = total_steps
        # What the steps optimize (litft.objectives, built by whoever composes the run): its loss_sum, count and figures.
        self.objective = objective
        self.compiled_kinds = 0  # kinds of block compiled (litft.model.compiling), the first compile of each not a recompile
        self.router_aux: list = []  # this step's router load-balancing losses (MoE), read and cleared by the loop
        self.whole_rows = carries_state(self.hf_model.config)  # one sample per padded row (litft.model.recurrent)
        self.state_boundaries = False  # packed rows, the state layers' kernels told where each sample starts (seq_idx)
        self.block_count = 1
        self.offloaded_bytes = 0  # the host memory the last training forward's saved tensors took (--train.activation_offload)
        self._offload: Optional[ActivationOffload] = None
        # A vision-language model computes its own positions (3-D rotary in Qwen-VL) and masks (Gemma 3's bidirectional image
        # attention) on padded rows; the image tensors of a batch come from ``images`` (litft.model.vision.ImageInputs).
        self.sees_images = sees_images(self.hf_model.config)
        if self.sees_images:
            answer_as_transformers_expects(self.hf_model)
        self.images = None
        self.stand_in = None  # the image encoder run on every rank where its weights are sharded (litft.model.vision.EncoderStandIn)
        self.offload_kind = ActivationOffload  # the estimate's trace counts instead of copying (CountedOffload)
        if train.activation_offload:
            blocks = transformer_blocks(self.hf_model)
            self.block_count = len(blocks)
            blocks[-1].register_forward_hook(self._past_last_block)

    def keep_samples_apart_in_kernels(self, on: bool) -> None:
        """Pack a state-carrying model's rows, its kernels restarting at each sample (litft.model.recurrent.boundary_kernels)."""
        self.state_boundaries = on and carries_state(self.hf_model.config)
        self.whole_rows = carries_state(self.hf_model.config) and not self.state_boundaries

    @property
    def hf_model(self) -> torch.nn.Module:
        """The transformers model itself, under peft's wrapper if LoRA was applied."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def router_aux_coef(self) -> float:
        """The weight of a MoE router's load-balancing loss, where the config asks for it (``output_router_logits``)."""
        config = self.hf_model.config
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(config, "output_router_logits", False) else 0.0

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, varlen: Optional[dict] = None,
                vision: Optional[dict] = None):
        """The logits (a summed loss where the head computes it), with the router's auxiliary loss as a pair where there is one.
        ``vision``: the batch's image tensors and per-token inputs, for a model that sees images."""
        if self.sees_images:
            position_ids, varlen = None, None
        # Where each sample of a row starts, for attention that keeps them apart (litft.model.attention).
        implementation = self.hf_model.config._attn_implementation
        extra = varlen if varlen is not None and implementation in PACKED_SAFE else {}
        if self.whole_rows and varlen is not None:
            # A sequence per padded row (litft.model.recurrent): its positions are 0..width-1, as transformers makes them without ids
            # (so nothing scans them), and the row bounds go to litft's attention under its own keys: transformers' state
            # layers would read cu_seq_lens as packed samples.
            position_ids = None
            extra = {"litft_cu": varlen["cu_seq_lens_q"], "litft_longest": varlen["max_length_q"], "litft_bounds": varlen["litft_bounds"]}
        if self.state_boundaries and varlen is not None and implementation in PACKED_SAFE:
            # Each token's sample, for mamba-ssm's and causal-conv1d's seq_idx (fla's gated delta rule reads cu_seq_lens_q).
            cu = varlen["cu_seq_lens_q"].to(input_ids.device)
            extra = {**varlen, "seq_idx": torch.repeat_interleave(
                torch.arange(len(cu) - 1, device=cu.device, dtype=torch.int32), torch.diff(cu), output_size=input_ids.numel()).reshape(input_ids.shape)}
        if implementation != SEGMENTS:
            extra = {key: value for key, value in extra.items() if not key.startswith("litft_")}
        offload = self.train_args.activation_offload and self.training and torch.is_grad_enabled()
        self._offload = offload = self.offload_kind(self.block_count) if offload else None
        if self.stand_in is not None:
            self.stand_in.pending = not has_pixels(vision)
        try:
            with packed_rows_known() if extra else contextlib.nullcontext(), offload.hooks() if offload else contextlib.nullcontext():
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra, **(vision or {}))
        finally:
            if self.stand_in is not None:
                self.stand_in.pending = False
        if offload is not None:
            self.offloaded_bytes, self._offload = offload.host_bytes, None
        aux = getattr(out, "aux_loss", None)
        return out.logits if aux is None else (out.logits, aux)

    @torch._dynamo.disable  # a compiled last block ends its graph here rather than guarding on each step's offload
    def _past_last_block(self, module, args, output) -> None:
        if self._offload is not None:
            self._offload.stop()

    def head_forward(self, batch: dict, targets: dict, per_token: bool, temperature: float = 1.0) -> Tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        """The forward with the head on the target tokens only where it can (litft.model.loss): their summed loss, or their log-probs
        (``per_token``, of the logits over ``temperature``); else the logits. With the router's auxiliary loss (MoE) or None,
        and whether the head computed it."""
        head = fused_head(self.hf_model)
        if head is not None:
            head.loss_targets = (targets["index"], targets["labels"], per_token, 1.0 / temperature)
        vision = batch.get("vision")  # made on the collate thread (training); validation's batches make theirs here
        if vision is None and "images" in batch:
            if self.images is None:
                raise LitftError("this batch carries images, and the model was given no processor for them (litft.model.vision.ImageInputs)")
            vision = self.images(batch)
        try:
            with counting_only(batch.get("real")):
                out = self(batch["input_ids"], batch.get("position_ids"), batch.get("varlen"), vision)
        finally:
            if head is not None:
                head.loss_targets = None
        value, aux = out if isinstance(out, tuple) else (out, None)
        return value, aux, head is not None

    def token_log_probs(self, batch: dict, temperature: float = 1.0) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-prob of each target token under softmax(logits / ``temperature``) (no full-vocabulary logits kept where the head
        computes them), and the router's auxiliary loss."""
        targets = batch["targets"]
        value, aux, fused = self.head_forward(batch, targets, per_token=True, temperature=temperature)
        if fused:
            return value, aux
        picked = value.reshape(-1, value.shape[-1]).index_select(0, targets["index"]).float()
        if temperature != 1.0:
            picked = picked / temperature
        return torch.log_softmax(picked, dim=-1).gather(1, targets["labels"][:, None]).squeeze(1), aux

    def with_router_aux(self, loss: torch.Tensor, aux: Optional[torch.Tensor], weight: int) -> torch.Tensor:
        """In training, a MoE router's load-balancing loss added as transformers adds it to a mean (weighted by what ``loss``
        sums over, so the loop's division gives the same mean); its value kept in ``router_aux`` for the log. Validation
        reports the objective's loss alone."""
        if aux is None or not self.training or not self.router_aux_coef:
            return loss
        self.router_aux.append(aux.detach().float())
        return loss + self.router_aux_coef * aux.float() * weight

    def take_router_aux(self) -> Optional[torch.Tensor]:
        """The mean router load-balancing loss of the step's micro-batches (on the device), or None; the list is emptied."""
        if not self.router_aux:
            return None
        mean, self.router_aux = torch.stack(self.router_aux).mean(), []
        return mean

    def loss_sum(self, batch: dict) -> torch.Tensor:
        """The objective's summed loss of the micro-batch (litft.objectives): what it sums over is ``objective.count``."""
        return self.objective.loss_sum(self, batch)

    def training_step(self, batch: dict) -> torch.Tensor:
        return self.loss_sum(batch)

    def validation_step(self, batch: dict) -> torch.Tensor:
        return self.loss_sum(batch)

    def predict_step(self, batch: dict) -> torch.Tensor:
        """What the objective scores with the model as it is (a preference reference's log-probs, before training)."""
        return self.objective.score(self, batch)

    def configure_optimizers(self):
        args = self.train_args
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            raise LitftError("the model has no trainable parameter; check --lora_target_modules")
        # The fused kernel updates every tensor in one pass: about 7x faster than the default
        # on the CPU (benchmarks/vs_hf_trainer.py), and what HF Trainer uses.
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        optimizer = torch.optim.AdamW(
            params, lr=args.learning_rate, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay, fused=fused or None
        )
        min_ratio = args.min_lr / args.learning_rate if args.learning_rate else 0.0
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, args.warmup_steps, self.total_steps, min_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

