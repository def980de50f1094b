"""Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU) in place of the model's own: ``--kernels``.

``auto`` takes them on a GPU where liger-kernel is installed (litft.run.plan), compiled blocks too: on one H200
(Llama-3.2-1B shape, bf16-true, 10a465b) compiled blocks ran 57,150 tok/s with them and 53,361 with inductor's own
fusions instead, and FP8 36,122 without them against 57,601 with them (cc1229b).
"""


def describe_kernels(requested: str, liger: bool) -> str:
    """The first screen's line: which fused kernels the blocks run, and why."""
    if liger:
        return f"kernels: Liger's RMSNorm, RoPE and SwiGLU ({'--kernels liger' if requested == 'liger' else 'auto: a GPU with liger-kernel'})"
    return f"kernels: the model's own ({'--kernels none' if requested == 'none' else 'auto: Liger only on a GPU with liger-kernel installed'})"


def use_liger_kernels(model) -> None:
    """Liger's fused norm, rotary and MLP kernels in the model (an optional extra, imported only when asked for).

    Only those: the loss on target tokens is litft's own (litft.model.loss).
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
