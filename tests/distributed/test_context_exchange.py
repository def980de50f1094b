"""The all-to-all around attention, alone: 4 gloo ranks in groups of 2 and of 4 attend their slices of whole rows and get
the outputs and gradients that attention over the whole rows gives, K/V heads shared evenly (N=2) or copied (N=4, 2 K/V heads),
with and without a sliding window."""

import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
LENGTHS = (5, 11)  # two samples in one row of 16 tokens, the second crossing every slice edge
WINDOW = 4  # a sliding window shorter than the second sample (Mistral, Gemma): it must survive the exchange


def whole_rows_and_slices(rank: int, store_path: str) -> None:
    from litft.model.attention import _attend_in_samples, segments_attention
    from litft.data.collate import cumulative_lengths
    from litft.parallel import context as context_parallel
    from litft.parallel.mesh import Mesh

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    width = sum(LENGTHS)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    varlen = cumulative_lengths(positions)
    generator = torch.Generator().manual_seed(0)  # the same whole rows on every rank
    q = torch.randn(1, HEADS, width, DIM, generator=generator)
    k, v = (torch.randn(1, KV_HEADS, width, DIM, generator=generator) for _ in range(2))
    weight = torch.randn(1, width, HEADS, DIM, generator=generator)
    module = types.SimpleNamespace(training=False)
    for window, size in ((None, 2), (None, 4), (WINDOW, 2)):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = _attend_in_samples(module, *whole, None, **varlen, sliding_window=window)[0]
        (expected * weight).sum().backward()
        split = Mesh(1, WORLD, context=size).build("cpu").place(rank)
        part = width // size
        mine = slice(split.place * part, (split.place + 1) * part)
        sliced = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        got = segments_attention(module, *sliced, None, **varlen, sliding_window=window, **{context_parallel.MARK: context_parallel.ContextGroup(split.group, size)})[0]
        (got * weight[:, mine]).sum().backward()
        torch.testing.assert_close(got, expected[:, mine], rtol=1e-5, atol=1e-6, msg=f"output, group of {size}, window {window}")
        for name, ours, reference in zip("qkv", sliced, whole):
            torch.testing.assert_close(ours.grad, reference.grad[:, :, mine], rtol=1e-5, atol=1e-6, msg=f"d{name}, group of {size}")
    dist.destroy_process_group()


def test_slices_attend_as_whole_rows(tmp_path):
    mp.spawn(whole_rows_and_slices, args=(str(tmp_path / "store"),), nprocs=WORLD)
