"""The real engine over several processes: `jax.distributed` and a mesh that spans them.

Every process runs the same program: the same workload, the same deterministic
scheduler and policy, and the same compiled step on its own shard of the
tensor-parallel mesh (`sharding.make_mesh` over `jax.devices()`, which lists
every process's devices once `initialize` has run). We chose identical
schedulers over "process 0 plans and broadcasts the descriptor" because the
step descriptor is the scheduler's whole output: a scheduler that is
deterministic given its inputs needs no second code path for the followers,
and the one thing that is not deterministic — the measured step time that
drives the virtual clock — is agreed instead: `agree_on_step` hands every
process process 0's measurement, and checks in the same collective that every
process packed the identical descriptor, so a divergence fails at the step it
happens rather than as wrong tokens later.

On a CPU the cross-process collectives go over gloo.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

import jax
import numpy as np

from orca_jax.core.step.engine_api import StepInputs

_DESCRIPTOR_FIELDS = ("token_ids", "positions", "cu_q_lens", "kv_lens", "page_indices",
                      "slot_mapping", "sample_indices", "num_seqs")


class DescriptorMismatchError(RuntimeError):
    """Processes packed different step descriptors (their schedulers diverged)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands in a multi-process run (all None/1: a single process)."""

    coordinator: Optional[str] = None  # host:port of process 0's coordinator service
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"--num_processes={self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process_id={self.process_id} must be in "
                             f"[0, --num_processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator:
            raise ValueError(f"--num_processes={self.num_processes} needs --coordinator=HOST:PORT "
                             "(process 0's address, the same on every process)")


def initialize(group: ProcessGroup) -> None:
    """Joins the process group (a no-op for one process). Call before any other jax use.

    On a CPU backend the cross-process collectives are set to gloo first (XLA's
    CPU client has none by default).
    """
    if group.num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=group.coordinator,
                               num_processes=group.num_processes, process_id=group.process_id)


def is_multiprocess() -> bool:
    """Whether this process is one of several (jax.distributed initialized with > 1)."""
    return jax.process_count() > 1


def descriptor_digest(inputs: StepInputs) -> int:
    """crc32 of the descriptor's arrays (31 bits, so it travels as an int32)."""
    crc = zlib.crc32(repr(inputs.bucket).encode())
    for field in _DESCRIPTOR_FIELDS:
        crc = zlib.crc32(np.ascontiguousarray(getattr(inputs, field)).tobytes(), crc)
    return crc & 0x7FFFFFFF


def agree_on_step(elapsed_s: float, inputs: StepInputs) -> float:
    """Process 0's step time, after checking every process ran the same descriptor.

    One small collective (an all-gather of two int32 per process) per step.

    Raises:
      DescriptorMismatchError: naming the processes whose descriptor differs
        from process 0's.
    """
    from jax.experimental import multihost_utils

    mine = np.array([descriptor_digest(inputs), round(elapsed_s * 1e6)], dtype=np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 2]
    digests = gathered[:, 0]
    if (digests != digests[0]).any():
        differ = np.flatnonzero(digests != digests[0]).tolist()
        raise DescriptorMismatchError(
            f"process {jax.process_index()}: the step descriptors of processes {differ} differ "
            f"from process 0's (bucket {inputs.bucket}); the schedulers diverged — every "
            "process must run the same workload, policy and flags")
    return float(gathered[0, 1]) / 1e6
