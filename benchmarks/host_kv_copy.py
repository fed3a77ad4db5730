"""Host KV tier copy bandwidth, beside the link presets the simulator prices (issue 27.5).

The simulator moves a page between the device and the host tier in
`latency + bytes / bandwidth` of a link preset (`pcie4`, `pcie5`, `nvlink-c2c`).
The jax engine copies real pages (`orca_jax.model.host_kv.HostKVStore`). This
probe measures, on the model's page geometry (default llama3-8b, bf16, 16-token
pages: 2 MiB a page over all layers), for blocks of `--pages` pages:

A. raw: a block already gathered on the device, moved to host memory and back:
   `pinned_host` (`jax.device_put` to the device's pinned host memory; where the
   backend offers it) and `numpy` (`np.asarray` out, `jax.device_put` in);
B. store: `HostKVStore.save` (gather from the cache pages + copy out) and
   `take` + `put` (copy in + scatter into the cache pages), each timed until the
   device is done (`block_until_ready` on the block or the cache): what a swap or a
   write-back and a host hit cost on the engine.

Each figure is the median of `--repeats` (after one untimed run that compiles),
as GB/s and microseconds a page, and the presets' GB/s beside them; the pages put
back are checked equal to those saved (exit 1 if not). A GPU session
runs it and commits the output as `benchmarks/results/host_kv_copy_<card>.txt`:

    python -m benchmarks.host_kv_copy               # a GPU: llama3-8b pages
    python -m benchmarks.host_kv_copy --dry_run     # CPU: tiny pages, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from orca_jax.model import engine as engine_lib
from orca_jax.model import host_kv
from orca_jax.model import llama as model_lib
from orca_jax.specs.hardware import get_kv_link
from orca_jax.specs.model_config import get_model_config

PRESETS = ("pcie4", "pcie5", "nvlink-c2c")


class _CacheOnly:
    """What `HostKVStore` asks of a `JaxEngine` (the cache's pages), without weights: a
    model-scale KV cache fits a device whose memory the weights would not leave."""

    def __init__(self, config: Any, num_pages: int, page_size: int, dtype: Any,
                 pages_per_seq: int) -> None:
        self.pages_per_seq = pages_per_seq
        self.cache = model_lib.init_kv_cache(config, num_pages=num_pages, page_size=page_size,
                                             dtype=dtype)
        self.kv_page_bytes = sum(b.nbytes // num_pages for b in (*self.cache.k, *self.cache.v))
        keys = iter(jax.random.split(jax.random.key(0), 2 * config.num_layers))
        self.cache = jax.tree.map(  # distinct values: a copy to the wrong page shows
            lambda a: jax.random.normal(next(keys), a.shape, a.dtype), self.cache)

    def gather_kv_pages(self, pages: np.ndarray) -> model_lib.KVCache:
        return engine_lib._gather_pages(self.cache, pages)

    def scatter_kv_pages(self, pages: np.ndarray, data: model_lib.KVCache,
                         rows: np.ndarray) -> None:
        self.cache = engine_lib._scatter_rows(self.cache, pages, data, rows)


def _median_s(run: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(run())  # compiles, allocates
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(what: str, num_pages: int, page_bytes: int, seconds: float) -> str:
    gbps = num_pages * page_bytes / seconds / 1e9
    return (f"{what:<28} {num_pages:>6} {num_pages * page_bytes / 2**20:>9.1f} "
            f"{seconds * 1e3:>9.3f} {seconds / num_pages * 1e6:>9.1f} {gbps:>8.2f}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dry_run", action="store_true",
                        help="tiny pages, blocks of 1 and 8, 3 repeats (CPU, seconds)")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.pages, args.repeats, args.dtype = "tiny", [1, 8], 3, "float32"
    config = get_model_config(args.model)
    device = jax.devices()[0]
    widest = max(args.pages)
    cache = _CacheOnly(config, num_pages=2 * widest + 1, page_size=args.page_size,
                       dtype=jnp.dtype(args.dtype), pages_per_seq=widest)
    page_bytes = cache.kv_page_bytes
    offered = sorted({m.kind for m in device.addressable_memories()})
    kinds = ["numpy"] + (["pinned_host"] if "pinned_host" in offered else [])
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
          f"memories {offered}")
    print(f"pages: {args.model} {args.dtype}, {args.page_size} tokens, "
          f"{page_bytes / 2**20:.3f} MiB a page (every layer's K and V); "
          f"auto host memory here: {host_kv.host_memory_kind(device)}")
    print(f"\n{'copy':<28} {'pages':>6} {'MiB':>9} {'ms':>9} {'us/page':>9} {'GB/s':>8}")
    for num_pages in args.pages:
        pages = np.arange(1, num_pages + 1, dtype=np.int32)
        block = jax.block_until_ready(cache.gather_kv_pages(pages))
        for kind in kinds:  # A. raw copies of a gathered block
            if kind == "numpy":
                out = lambda: jax.tree.map(np.asarray, block)  # noqa: E731
                host = out()
                back = lambda: jax.device_put(host, device)  # noqa: E731
            else:
                pinned = lambda a: jax.device_put(  # noqa: E731
                    a, a.sharding.with_memory_kind("pinned_host"))
                out = lambda: jax.tree.map(pinned, block)  # noqa: E731
                host = jax.block_until_ready(out())
                back = lambda: jax.tree.map(  # noqa: E731
                    lambda a: jax.device_put(a, a.sharding.with_memory_kind("device")), host)
            print(_row(f"raw {kind} out", num_pages, page_bytes,
                       _median_s(out, args.repeats)))
            print(_row(f"raw {kind} in", num_pages, page_bytes,
                       _median_s(back, args.repeats)))
        for kind in kinds:  # B. through the host tier's store, gather and scatter included
            store = host_kv.HostKVStore(cache, kind)
            keys = list(range(num_pages))

            def save() -> Any:
                store.save(keys, pages)
                return jax.tree.leaves(store._blocks[max(store._blocks)].data)

            def load() -> Any:
                store.put(store.take(keys), pages + num_pages)
                return cache.cache

            print(_row(f"store {kind} save", num_pages, page_bytes,
                       _median_s(save, args.repeats)))
            print(_row(f"store {kind} take+put", num_pages, page_bytes,
                       _median_s(load, args.repeats)))
            same = jax.tree.map(lambda a, b: bool((a == b).all()),
                                cache.gather_kv_pages(pages),
                                cache.gather_kv_pages(pages + num_pages))
            if not all(jax.tree.leaves(same)):
                print(f"store {kind}: the pages put back differ from those saved")
                return 1
    print("\nlink presets the simulator prices a host-tier move with (one direction):")
    for name in PRESETS:
        link = get_kv_link(name)
        print(f"  {name:<12} {link.bytes_per_s / 1e9:>7.1f} GB/s, {link.latency_s * 1e6:.0f} us "
              f"latency: {(link.latency_s + page_bytes / link.bytes_per_s) * 1e6:.1f} us a page")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
