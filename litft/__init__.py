"""litft: fine-tune and pretrain Hugging Face causal language models with Lightning Fabric."""

import logging

# Before anything imports them: bitsandbytes (imported by peft) advises installing an optional kernel package on
# every process, and liger-kernel warns about every other vendor's backend it cannot import.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
logging.getLogger("liger_kernel.backends.registry").addFilter(lambda record: "could not be imported" not in record.getMessage())
# torchao (imported by transformers' quantizers and peft wherever it is installed) names every CUDA extension it cannot load
# on a machine without them, and registers enums that this torch already supports, which torch's pytree warns about.
logging.getLogger("torchao").addFilter(lambda record: "Failed to load" not in record.getMessage())
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "natively supported by torch.compile" not in record.getMessage())

__version__ = "0.1.0"
