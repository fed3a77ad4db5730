"""Priced KV transfers between a prefill and a decode replica, and the links' queues.

A request's KV is `layers x KV heads x head dim x 2 (K and V) x dtype bytes` per
token. Under tensor parallelism each GPU holds its share of the KV heads and
sends it over its own link at the same time, so a transfer's time is one
shard's bytes: `latency + shard bytes / bandwidth` (`KVTransferCost`). A link
is one (prefill replica, decode replica) pair; at most `max_concurrent`
transfers are in flight on it, the others queue in arrival order
(`LinkQueues`), and one also waits while the decode pool has no room for it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterator

from orca_jax.specs.hardware import KVLinkSpec
from orca_jax.specs.model_config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVTransferCost:
    """What moving one request's KV costs.

    Attributes:
      link: the path's latency, bandwidth and concurrency.
      bytes_per_token: KV bytes of one token on one TP shard.
    """

    link: KVLinkSpec
    bytes_per_token: int

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_token, int) or self.bytes_per_token < 1:
            raise ValueError(f"KVTransferCost.bytes_per_token must be an integer >= 1, "
                             f"got {self.bytes_per_token!r}")

    def num_bytes(self, num_tokens: int) -> int:
        """Bytes one shard sends for `num_tokens` tokens of KV."""
        return self.bytes_per_token * int(num_tokens)

    def seconds(self, num_tokens: int) -> float:
        """The transfer's time once it starts: latency plus bytes over bandwidth."""
        return self.link.latency_s + self.num_bytes(num_tokens) / self.link.bytes_per_s


def kv_transfer_cost(model: ModelConfig, link: KVLinkSpec, *, tp: int = 1,
                     dtype_bytes: int = 2) -> KVTransferCost:
    """The transfer cost of `model`'s KV over `link`, split over `tp` shards.

    A shard holds `ceil(num_kv_heads / tp)` KV heads (heads are replicated when
    there are fewer than shards).
    """
    if tp < 1 or dtype_bytes < 1:
        raise ValueError(f"kv_transfer_cost: tp and dtype_bytes must be >= 1, got {tp}, "
                         f"{dtype_bytes}")
    heads = math.ceil(model.num_kv_heads / tp)
    return KVTransferCost(link=link, bytes_per_token=(
        model.num_layers * heads * model.head_dim * 2 * dtype_bytes))


@dataclasses.dataclass
class Transfer:
    """One request's KV on its way (its fields fill in as it goes)."""

    request: int
    source: int  # prefill replica (its index in the prefill pool)
    target: int  # decode replica (its index in the decode pool)
    num_tokens: int  # KV tokens carried: the prompt
    ready_s: float  # queued: the first token was sampled
    start_s: float = math.nan
    end_s: float = math.nan


class LinkQueues:
    """Each link's FIFO of transfers waiting to start, and its transfers in flight."""

    def __init__(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self._waiting: dict[tuple[int, int], collections.deque[Transfer]] = (
            collections.defaultdict(collections.deque))
        self._in_flight: collections.Counter[tuple[int, int]] = collections.Counter()

    def enqueue(self, transfer: Transfer) -> None:
        self._waiting[transfer.source, transfer.target].append(transfer)

    def startable(self, target: int) -> Iterator[Transfer]:
        """Heads of the queues into decode replica `target` whose link has a free slot,
        oldest first (the caller starts each it can: `start`)."""
        heads = [queue[0] for (_, to), queue in self._waiting.items()
                 if to == target and queue
                 and self._in_flight[queue[0].source, to] < self.max_concurrent]
        yield from sorted(heads, key=lambda t: (t.ready_s, t.request))

    def start(self, transfer: Transfer, start_s: float, seconds: float) -> None:
        """Takes the head `transfer` off its queue and puts it in flight."""
        queue = self._waiting[transfer.source, transfer.target]
        if not queue or queue[0] is not transfer:
            raise ValueError(f"LinkQueues.start: request {transfer.request} is not at the head "
                             "of its link's queue")
        queue.popleft()
        self._in_flight[transfer.source, transfer.target] += 1
        transfer.start_s = start_s
        transfer.end_s = start_s + seconds

    def finish(self, transfer: Transfer) -> None:
        """Frees the transfer's slot on its link."""
        self._in_flight[transfer.source, transfer.target] -= 1

    def num_waiting(self, target: int) -> int:
        """Transfers queued (not started) into decode replica `target`."""
        return sum(len(q) for (_, to), q in self._waiting.items() if to == target)
