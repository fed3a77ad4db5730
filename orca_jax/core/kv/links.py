"""The links KV pages cross between memory tiers, and their queues.

A link (PCIe between the device and host memory, NVMe between host memory and
a disk, an RDMA path to a remote store) has a latency and a bandwidth, and two
directions that do not share bandwidth (both PCIe and NVMe are full duplex):
`down` (towards the slower tier: a swap out, a write-back or write-through)
and `up` (towards the device: a swap in, a prefix hit loaded). Each direction
is a FIFO carrying one transfer at a time: a transfer starts when the one
before it on the same direction has ended, and takes `latency + bytes /
bandwidth` (as `orca_jax.cluster.transfers` prices a disaggregated handoff).

The numbers come from the hardware presets (`orca_jax.specs.hardware.KV_LINK_PRESETS`)
through `TierConfig`; this module holds plain numbers only, as the core may not
import the presets.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LinkQueue:
    """One direction of a link: transfers queue and run one after another.

    Attributes:
      latency_s: fixed time of one transfer.
      bytes_per_s: the direction's bandwidth.
      free_at_s: when the last queued transfer ends (the next starts then or later).
      num_bytes: bytes carried so far.
      num_transfers: transfers carried so far.
    """

    latency_s: float
    bytes_per_s: float
    free_at_s: float = 0.0
    num_bytes: int = 0
    num_transfers: int = 0

    def seconds(self, num_bytes: int) -> float:
        """A transfer's time once it starts (no queueing)."""
        return self.latency_s + num_bytes / self.bytes_per_s

    def enqueue(self, ready_s: float, num_bytes: int) -> float:
        """Queues a transfer that may start at `ready_s`; returns when it ends."""
        start = max(ready_s, self.free_at_s)
        self.free_at_s = end = start + self.seconds(num_bytes)
        self.num_bytes += int(num_bytes)
        self.num_transfers += 1
        return end


@dataclasses.dataclass
class Link:
    """A full-duplex link: a queue each way.

    Attributes:
      name: the preset's name (`pcie4`, `nvme`, ...).
      down: towards the slower tier.
      up: towards the device.
    """

    name: str
    down: LinkQueue
    up: LinkQueue

    @classmethod
    def of(cls, name: str, latency_s: float, bytes_per_s: float) -> "Link":
        """A link of these numbers, both directions alike."""
        return cls(name, LinkQueue(latency_s, bytes_per_s), LinkQueue(latency_s, bytes_per_s))
