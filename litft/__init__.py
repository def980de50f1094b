"""litft: fine-tune and pretrain Hugging Face causal language models with Lightning Fabric."""

__version__ = "0.1.0"
