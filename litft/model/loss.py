"""The loss on target tokens only: output head and cross-entropy fused, a chunk of tokens at a time.

A plain step computes logits for every token of the batch (prompts and padding
too), casts all of them to fp32 and keeps them, their log-softmax and their
gradients for the backward: at a 128k vocabulary and 8 x 2k tokens that is tens
of GB. Here the head runs only on the tokens that carry loss, in chunks, and
each chunk's gradients (for the hidden states and the head's weight) are made
at once, in the forward, so no chunk's logits outlive it. The backward only
scales what the forward made. The head is replaced only where it is a plain
linear layer whose logits feed the loss unchanged (no soft-capping or scaling,
no adapter on it); elsewhere the model's own head and a plain cross-entropy run.
"""

import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_LOGIT_BYTES = 256 * 2**20  # fp32 logits of one chunk


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))


class TargetCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, with its gradients made chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows: int):
        grads = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if grads[0] else None
        # The head's gradient is summed in its own dtype by one matmul per chunk into it (as Liger's fused loss does): a sum in
        # fp32 kept a full fp32 copy and each chunk's product twice over, 9.8 GiB per rank for Llama-3-70B's 128k x 8k head.
        grad_weight = torch.zeros_like(weight) if grads[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and grads[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start : start + rows], targets[start : start + rows]
            logits = F.linear(h, weight, bias).float()
            norm = torch.logsumexp(logits, dim=-1)
            total += (norm - logits.gather(1, y[:, None]).squeeze(1)).sum()
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            # d(sum of -log softmax[y]) / d logits = softmax - one_hot(y)
            probs = logits.sub_(norm[:, None]).exp_()
            probs[torch.arange(len(y), device=y.device), y] -= 1
            g = probs.to(h.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = g @ weight
            if grad_weight is not None:
                grad_weight.addmm_(g.t(), h)
            if grad_bias is not None:
                grad_bias += probs.sum(0)
        ctx.save_for_backward(grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_output.to(g.dtype)  # noqa: E731
        return scale(grad_hidden), scale(grad_weight), scale(grad_bias), None, None


class TargetLogProbs(torch.autograd.Function):
    """log p(target) of each token under ``(hidden @ weight.T + bias) * scale``, a chunk of tokens at a time (``scale``: one
    over RL's sampling temperature).

    A preference objective weighs each token's log-prob by its sequence's gradient, known only after every sequence
    is summed: so the forward keeps no logits and the backward computes each chunk's again (one more head matmul
    than ``TargetCrossEntropy``, and still no full-vocabulary logits alive).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows: int, scale: float = 1.0):
        out = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            logits = F.linear(hidden[start : start + rows], weight, bias).float()
            if scale != 1.0:
                logits.mul_(scale)
            y = targets[start : start + rows]
            out[start : start + rows] = logits.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.rows, ctx.scale = rows, scale
        # The backward computes the logits again as the forward did: under the same autocast, if one was on.
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        return out

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.autocast is None:
            return TargetLogProbs.gradients(ctx, grad_output)
        device, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype):
            return TargetLogProbs.gradients(ctx, grad_output)

    @staticmethod
    def gradients(ctx, grad_output):
        hidden, weight, bias, targets = ctx.saved_tensors
        grads = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if grads[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and grads[2] else None
        for start in range(0, hidden.shape[0], ctx.rows):
            h, y, g_out = hidden[start : start + ctx.rows], targets[start : start + ctx.rows], grad_output[start : start + ctx.rows].float()
            # d log softmax(s z)[y] / d z = s (one_hot(y) - softmax(s z)), scaled by each token's incoming gradient
            logits = F.linear(h, weight, bias).float()
            g = torch.softmax(logits.mul_(ctx.scale) if ctx.scale != 1.0 else logits, dim=-1).mul_(-g_out[:, None] * ctx.scale)
            g[torch.arange(len(y), device=y.device), y] += g_out * ctx.scale
            if grad_bias is not None:
                grad_bias += g.sum(0)
            g = g.to(h.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + ctx.rows] = g @ weight.to(g.dtype)
            if grad_weight is not None:
                grad_weight += (g.t() @ h.to(g.dtype)).float()
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return grad_hidden, cast(grad_weight, weight), cast(grad_bias, bias), None, None, None


def target_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], index: torch.Tensor, labels: torch.Tensor,
                     scale: float = 1.0) -> torch.Tensor:
    """Log-probs of the tokens at ``index`` (flat positions in the batch) predicting ``labels``, one per token, under the
    softmax of the logits times ``scale``."""
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    return TargetLogProbs.apply(flat, weight, bias, labels, chunk_rows(weight.shape[0]), scale)


def target_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], index: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed loss of the tokens at ``index`` (flat positions in the batch) predicting ``labels``."""
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    return TargetCrossEntropy.apply(flat, weight, bias, labels, chunk_rows(weight.shape[0]))


def _head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    """The head, or, while ``self.loss_targets`` is set by the step, the summed loss of the target tokens (their log-probs, per token)."""
    if self.loss_targets is None:
        return F.linear(hidden, self.weight, self.bias)
    index, labels, per_token, scale = self.loss_targets
    if per_token:
        return target_log_probs(hidden, self.weight, self.bias, index, labels, scale)
    return target_loss(hidden, self.weight, self.bias, index, labels)


class _Backbone(dict):
    """What the probe's stand-in backbone returns: the hidden states as a model output holds them, any other field None."""

    def __getattr__(self, name):
        return self.get(name)

    def __getitem__(self, key):
        return self.get("last_hidden_state") if key == 0 else dict.get(self, key)

    def to_tuple(self):
        return (self.last_hidden_state,)


def head_feeds_loss_unchanged(hf_model) -> bool:
    """Whether the model's forward returns its head's output as it is, found by one call of that forward on the meta device
    with the backbone and the head stood in for: the logits it returns must be the very tensor the head gave.

    Models that scale, cap or multiply logits after the head (Granite, Cohere, Gemma 2, Falcon-H1's ``lm_head_multiplier``...)
    must keep their head: a fused head returns a loss, and whatever the forward does to "logits" afterwards would be done to
    that loss instead. A forward the probe cannot run keeps the model's own head.
    """
    head, backbone = hf_model.get_output_embeddings(), hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    if head is None or backbone is None or backbone is hf_model:
        return False
    text = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    marker = torch.empty(1, 2, 3, device="meta")
    hidden = torch.empty(1, 2, text.hidden_size, device="meta")
    kept = backbone.forward, head.forward
    backbone.forward = lambda *args, **kwargs: _Backbone(last_hidden_state=hidden)
    head.forward = lambda *args, **kwargs: marker
    try:
        out = hf_model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"), use_cache=False)
    except Exception:  # noqa: BLE001 - a forward that needs more than the probe gives keeps its own head
        return False
    finally:
        backbone.forward, head.forward = kept
    logits = getattr(out, "logits", None)
    return logits is marker


def fuse_target_loss(hf_model) -> bool:
    """Let the model's output head compute the loss of the target tokens itself, where that is exact; whether it does.

    The head stays the module it was (FSDP and ZeRO-3 gather its weight around its
    forward as before); only what its forward returns changes, while a step asks for a loss.
    """
    head = hf_model.get_output_embeddings()
    if type(head) is not nn.Linear or not head_feeds_loss_unchanged(hf_model):
        return False
    head.loss_targets = None
    head.forward = types.MethodType(_head_forward, head)
    return True


def fused_head(hf_model) -> Optional[nn.Module]:
    """The output head when it computes the loss itself (``fuse_target_loss``), else None."""
    head = hf_model.get_output_embeddings()
    return head if hasattr(head, "loss_targets") else None
