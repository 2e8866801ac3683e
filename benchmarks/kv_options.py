"""The KV-cache work a batched decode step adds, per design, without the model (docs/batching.md).

Per step and layer, for B requests of L cached tokens each feeding n new tokens:
- ``stacked``: per-request ``DynamicCache`` layers (concatenation on update, as transformers does) stacked into
  one [B, heads, L + n, head_dim] tensor for the batched pass: two full copies of every request's cache per step;
- ``rows`` (hetspec/kv.py): one preallocated buffer, new tokens written at each row's slots, the pass reads a
  view of the rows: no copy of the cache.

    python -m benchmarks.kv_options --layers 28 --kv-heads 2 --head-dim 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def stacked_step(caches: list[list[torch.Tensor]], new: torch.Tensor) -> None:
    for layer in range(len(caches[0])):
        grown = [torch.cat([cache[layer], new[index:index + 1]], dim=-2) for index, cache in enumerate(caches)]
        for index, cache in enumerate(caches):
            cache[layer] = grown[index]
        torch.cat(grown, dim=0)  # the batch the pass attends to


def rows_step(buffers: list[torch.Tensor], lengths: torch.Tensor, new: torch.Tensor) -> None:
    batch, fed = new.shape[0], new.shape[2]
    rows = torch.arange(batch)[:, None]
    slots = lengths[:, None] + torch.arange(fed)
    for buffer in buffers:
        buffer[rows, :, slots] = new.transpose(1, 2)
        buffer[:batch, :, :int(lengths.max()) + fed]  # a view


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--fed", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    print("batch  stacked ms/step  rows ms/step")
    for batch in args.batch_sizes:
        shape = (1, args.kv_heads, args.context, args.head_dim)
        # keys and values: two tensors per layer
        caches = [[torch.randn(shape).to(dtype) for _ in range(2 * args.layers)] for _ in range(batch)]
        new = torch.randn(batch, args.kv_heads, args.fed, args.head_dim).to(dtype)
        tick = time.perf_counter()
        for _ in range(args.steps):
            stacked_step(caches, new)
            for cache in caches:  # roll back what was fed, as a rejection would, so L stays put
                for layer in range(len(cache)):
                    cache[layer] = cache[layer][:, :, :args.context]
        stacked = (time.perf_counter() - tick) / args.steps * 1000
        capacity = args.context + args.fed
        buffers = [torch.zeros(batch, args.kv_heads, capacity, args.head_dim, dtype=dtype) for _ in range(2 * args.layers)]
        lengths = torch.full((batch,), args.context)
        tick = time.perf_counter()
        for _ in range(args.steps):
            rows_step(buffers, lengths, new)
        rows = (time.perf_counter() - tick) / args.steps * 1000
        print(f"{batch:5d}  {stacked:15.2f}  {rows:12.2f}")


if __name__ == "__main__":
    main()
