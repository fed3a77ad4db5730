"""The jax engine's host KV tier: pages copied between the device cache and host memory.

`HostKVStore` is the `orca_jax.core.kv.tier_contents.PageContents` a `JaxEngine`
hands the scheduler when a run has a host tier (`JaxEngine.host_kv_store`). A
copy out gathers the pages on the device into a block of their own (one jitted
gather; the block is a fresh buffer, so a later step writing those cache pages
cannot change it) and moves the block to host memory:

- `pinned_host`: a jax array in the device's pinned host memory
  (`memory_kind="pinned_host"`), where the backend offers it (a GPU). The copy is
  asynchronous: the host goes on planning while the device's copy engine runs it,
  in order after the steps dispatched before it.
- `numpy`: a numpy array (CPU, or a backend without pinned host memory). The copy
  waits for the device to reach it (`np.asarray`), so the host waits for the step
  in flight before it.

A copy in moves a block back to the device and scatters its rows into the given
cache pages (one jitted scatter, the cache donated as a step donates it). Both
are dispatched on the engine's cache in the scheduler's order, which is the
device's program order: a step dispatched later reads what a copy in wrote, and a
copy out reads what the steps dispatched before it wrote, never a later one's.

Blocks are padded to a power of two of pages (at most the page-table width, so
each width compiles one gather and one scatter); a block is freed once no key
and no taken handle needs it.
"""

from __future__ import annotations

import itertools
import time
from typing import Hashable, Protocol, Sequence

import jax
import numpy as np

from orca_jax.core.step.engine_api import NULL_PAGE
from orca_jax.model import llama as model_lib

HOST_KV_MEMORIES = ("auto", "pinned_host", "numpy")


class PageCopier(Protocol):
    """What the store asks of an engine (`JaxEngine` is one): its cache's pages."""

    @property
    def pages_per_seq(self) -> int: ...

    @property
    def kv_page_bytes(self) -> int: ...

    def gather_kv_pages(self, pages: np.ndarray) -> model_lib.KVCache: ...  # [W]

    def scatter_kv_pages(self, pages: np.ndarray,  # [W]
                         data: model_lib.KVCache, rows: np.ndarray) -> None: ...  # [W]


def host_memory_kind(device: jax.Device, choice: str = "auto") -> str:
    """Where the host tier keeps pages: `pinned_host` or `numpy`.

    `auto` takes pinned host memory where the device is an accelerator that offers it,
    else numpy (a CPU's "pinned host" memory is its own memory: nothing to gain).

    Raises:
      ValueError: an unknown choice, or `pinned_host` on a device without it.
    """
    if choice not in HOST_KV_MEMORIES:
        raise ValueError(f"host KV memory {choice!r} is not one of {HOST_KV_MEMORIES}")
    offered = {memory.kind for memory in device.addressable_memories()}
    if choice == "pinned_host" and "pinned_host" not in offered:
        raise ValueError(f"host KV memory 'pinned_host': device {device} offers "
                         f"{sorted(offered)}; use 'numpy'")
    if choice == "auto":
        return "pinned_host" if device.platform != "cpu" and "pinned_host" in offered else "numpy"
    return choice


def _width(num_pages: int, limit: int) -> int:
    """A block's padded width: the next power of two, at most `limit`."""
    return min(1 << max(num_pages - 1, 0).bit_length(), limit)


class _Block:
    """Pages' KV in host memory, `width` rows (the first `num_pages` real)."""

    __slots__ = ("data", "num_keys")

    def __init__(self, data: model_lib.KVCache) -> None:
        self.data = data  # layers x [width, page_size, kv_heads, head_dim], in host memory
        self.num_keys = 0  # keys whose KV is a row here


class HostKVStore:
    """A host KV tier's pages for `engine`, kept in `memory_kind` host memory.

    Args:
      engine: the engine whose cache pages it copies.
      memory_kind: `pinned_host` or `numpy` (`host_memory_kind`).
    """

    def __init__(self, engine: PageCopier, memory_kind: str) -> None:
        self._engine = engine
        self.memory_kind = memory_kind
        self._blocks: dict[int, _Block] = {}
        self._where: dict[Hashable, tuple[int, int]] = {}  # key -> (block, row)
        self._ids = itertools.count()
        self._warm = False
        self.stats = dict(pages_out=0, pages_in=0, bytes_out=0, bytes_in=0,
                          copy_out_host_s=0.0, copy_in_host_s=0.0)

    def warmup(self) -> None:
        """Compiles the copies of every block width (on the null page), so that no copy
        compiles mid-run; once."""
        if self._warm:
            return
        limit = self._engine.pages_per_seq
        widths = sorted({_width(n, limit) for n in range(1, limit + 1)})
        for width in widths:
            null = np.full(width, NULL_PAGE, np.int32)
            block = self._to_host(self._engine.gather_kv_pages(null))
            self._engine.scatter_kv_pages(null, self._to_device(block), np.zeros(width, np.int32))
        self._warm = True

    @property
    def num_pages(self) -> int:
        """Pages held (one per key)."""
        return len(self._where)

    # ------------------------------------------------------------------ out
    def save(self, keys: Sequence[Hashable], device_pages: np.ndarray) -> None:  # [n]
        """Copies these device pages' KV to host memory, page i under `keys[i]`."""
        if len(keys) != len(device_pages):
            raise ValueError(f"HostKVStore.save: {len(keys)} keys for {len(device_pages)} pages")
        start = time.perf_counter()
        limit = self._engine.pages_per_seq
        pages = np.asarray(device_pages, np.int32)
        for lo in range(0, len(keys), limit):
            chunk = pages[lo:lo + limit]
            padded = np.full(_width(chunk.size, limit), NULL_PAGE, np.int32)
            padded[:chunk.size] = chunk
            block = _Block(self._to_host(self._engine.gather_kv_pages(padded)))
            block_id = next(self._ids)
            self._blocks[block_id] = block
            self.discard(keys[lo:lo + limit])
            for row, key in enumerate(keys[lo:lo + limit]):
                self._where[key] = (block_id, row)
                block.num_keys += 1
        self.stats["pages_out"] += len(keys)
        self.stats["bytes_out"] += len(keys) * self._engine.kv_page_bytes
        self.stats["copy_out_host_s"] += time.perf_counter() - start

    def _to_host(self, kv: model_lib.KVCache) -> model_lib.KVCache:
        if self.memory_kind == "numpy":
            return jax.tree.map(np.asarray, kv)  # waits for the device to reach the gather
        return jax.tree.map(
            lambda a: jax.device_put(a, a.sharding.with_memory_kind("pinned_host")), kv)

    # ------------------------------------------------------------------- in
    def take(self, keys: Sequence[Hashable]) -> list[tuple[model_lib.KVCache, list[int],
                                                           list[int]]]:
        """These keys' KV as (block data, positions in `keys`, rows) per block, in order
        of first use: it holds the blocks, so a later `discard` does not lose them."""
        groups: dict[int, tuple[model_lib.KVCache, list[int], list[int]]] = {}
        for position, key in enumerate(keys):
            where = self._where.get(key)
            if where is None:
                raise KeyError(f"HostKVStore: no KV for {key!r} in host memory")
            block_id, row = where
            group = groups.setdefault(block_id, (self._blocks[block_id].data, [], []))
            group[1].append(position)
            group[2].append(row)
        return list(groups.values())

    def put(self, taken: list[tuple[model_lib.KVCache, list[int], list[int]]],
            device_pages: np.ndarray) -> None:  # [n]
        """Copies `take`'s KV into these device pages, in order."""
        start = time.perf_counter()
        pages = np.asarray(device_pages, np.int32)
        count = 0
        for data, positions, rows in taken:
            width = jax.tree.leaves(data)[0].shape[0]
            target = np.full(width, NULL_PAGE, np.int32)  # padding rows land on the null page
            source = np.zeros(width, np.int32)
            target[:len(positions)] = pages[positions]
            source[:len(rows)] = rows
            self._engine.scatter_kv_pages(target, self._to_device(data), source)
            count += len(positions)
        if count != pages.size:
            raise ValueError(f"HostKVStore.put: KV of {count} pages for {pages.size} pages")
        self.stats["pages_in"] += count
        self.stats["bytes_in"] += count * self._engine.kv_page_bytes
        self.stats["copy_in_host_s"] += time.perf_counter() - start

    def _to_device(self, data: model_lib.KVCache) -> model_lib.KVCache:
        if self.memory_kind == "numpy":
            return data  # the jitted scatter takes host arrays itself
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind("device")),
                            data)

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forgets these keys' KV; a block no key needs any more is freed."""
        for key in keys:
            where = self._where.pop(key, None)
            if where is None:
                continue
            block = self._blocks[where[0]]
            block.num_keys -= 1
            if block.num_keys == 0:
                del self._blocks[where[0]]

    def facts(self) -> dict[str, object]:
        """Its memory kind and what it copied (pages and bytes each way, host seconds)."""
        return {"host_kv_memory": self.memory_kind,
                **{f"host_kv_{name}": (round(value, 6) if isinstance(value, float) else value)
                   for name, value in self.stats.items()}}

