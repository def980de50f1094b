"""What the memory benchmarks share: a Llama shape from flags, and peak memory growth.

Memory is the process's anonymous resident memory (Linux): pages mapped from
safetensors or checkpoint files are page cache, shared and evictable, and are not
what runs a machine out of memory.
"""

import argparse
import os
import threading
from pathlib import Path


def python_path(*first: Path) -> str:
    """A child process's PYTHONPATH: ``first``, then the caller's own, so wheels a GPU call installed there stay importable."""
    return os.pathsep.join(filter(None, (*map(str, first), os.environ.get("PYTHONPATH"))))


def resident_mb(field: str = "RssAnon") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


class PeakGrowth:
    """``with PeakGrowth() as peak: ...``; then ``peak.mb`` is the largest growth seen, sampled every 2 ms."""

    def __enter__(self):
        self.before, self.peak, self.done = resident_mb(), 0.0, threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        return self

    def _sample(self):
        while not self.done.is_set():
            self.peak = max(self.peak, resident_mb())
            self.done.wait(0.002)

    def __exit__(self, *exc):
        self.done.set()
        self.sampler.join()
        self.mb = max(self.peak, resident_mb()) - self.before
        return False


def shape_parser(description: str, layers: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--devices", type=int, default=2)
    return parser


def llama_shape(args):
    """An untied Llama of the flags' shape, and its sizes in fp32 MB: (config, one block, one embedding, whole model)."""
    from transformers import LlamaConfig

    h = args.hidden
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 3, num_hidden_layers=args.layers,
        num_attention_heads=h // 64, num_key_value_heads=h // 128, tie_word_embeddings=False,
    )
    block_mb = 4 * (2 * h * h + 2 * h * (h // 2) + 3 * h * h * 3) / 2**20
    embedding_mb = 4 * args.vocab * h / 2**20
    return config, block_mb, embedding_mb, block_mb * args.layers + 2 * embedding_mb


def model_folder(work: Path, hidden: int, layers: int, max_positions: int = 256) -> Path:
    """A Llama with random weights and litft-tiny's tokenizer (its 384-token vocabulary keeps the blocks the bulk)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from litft.model.tiny import ensure_tiny_model

    folder = work / f"llama-{hidden}x{layers}"
    if not (folder / "config.json").is_file():
        config = LlamaConfig(
            vocab_size=384, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
            num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=max_positions,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(folder)
    return folder
