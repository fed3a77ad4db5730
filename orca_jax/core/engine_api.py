"""The contract between the host scheduler and an engine: StepInputs in, StepOutput out.

`pack()` (orca_jax.core.packing) turns a policy's StepPlan into a `StepInputs`: flat,
fixed-shape numpy arrays padded to a bucket `(T, S)`. Every engine, real or
simulated, receives exactly these arrays, so every policy drives the same
compiled steps.

Layout (T = bucket tokens, S = bucket sequences, P = pages per sequence):
  * Sequence i of the step owns flat tokens `cu_q_lens[i]:cu_q_lens[i+1]`. Its
    query j sits at absolute position `kv_lens[i] - q_len_i + j`: the step first
    writes the new tokens' K/V at `slot_mapping`, then each sequence attends
    causally over its first `kv_lens[i]` cached tokens.
  * Rows past `cu_q_lens[num_seqs]` and sequences past `num_seqs` are padding:
    their tokens are 0, their slots point into page 0 (the null page, never
    handed to a request), their `kv_lens` are 0 and their `cu_q_lens` repeat the
    last real offset, so they cost nothing and write nothing anyone reads.
  * `sample_indices[i]` is the flat index of sequence i's last token: its logits
    give the token sampled for sequence i (used only when the step completes the
    sequence's known tokens; the scheduler ignores the others).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np
from numpy.typing import NDArray

NULL_PAGE = 0  # page 0 is the padding target; the KV manager never allocates it


class EngineConfigError(ValueError):
    """The engine cannot be built as configured; the message names the setting (e.g. `tp`)."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A compiled step shape: at most `num_tokens` tokens of at most `num_seqs` sequences."""

    num_tokens: int  # T
    num_seqs: int  # S


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's descriptor, padded to `bucket`. All arrays are numpy, host side."""

    bucket: Bucket
    token_ids: NDArray[np.int32]  # [T] token ids of the flat token stack
    positions: NDArray[np.int32]  # [T] absolute position of each token in its sequence
    cu_q_lens: NDArray[np.int32]  # [S+1] cumulative query lengths; padded seqs repeat the end
    kv_lens: NDArray[np.int32]  # [S] cached tokens per sequence after this step's writes
    page_indices: NDArray[np.int32]  # [S, P] KV pages of each sequence, in order
    slot_mapping: NDArray[np.int32]  # [T] flat KV slot (page * page_size + offset) per token
    sample_indices: NDArray[np.int32]  # [S] flat index of each sequence's last token
    num_seqs: NDArray[np.int32]  # [1] number of real sequences
    temperature: NDArray[np.float32]  # [S] 0 means greedy
    top_k: NDArray[np.int32]  # [S] 0 means no top-k cut
    top_p: NDArray[np.float32]  # [S] 1 means no nucleus cut
    rng_seeds: NDArray[np.uint32]  # [S] per-request seed, mixed with the position on device

    @property
    def num_real_tokens(self) -> int:
        """Tokens of real sequences (the rest of the T rows is padding)."""
        return int(self.cu_q_lens[int(self.num_seqs[0])])

    @property
    def num_real_seqs(self) -> int:
        return int(self.num_seqs[0])


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What an engine returns for one step."""

    sampled_tokens: NDArray[np.int32]  # [S] token sampled for each sequence (padding: any)
    step_s: float  # seconds the step took (measured, profiled, or from a cost model)


class Engine(Protocol):
    """What the scheduler needs of an engine (JaxEngine and SimEngine both are)."""

    @property
    def name(self) -> str:
        """Short name written to results (`sim`, `jax`)."""

    @property
    def needs_token_ids(self) -> bool:
        """Whether `StepInputs.token_ids` must hold real ids (a simulator needs none)."""

    def warmup(self, buckets: Sequence[Bucket]) -> None:
        """Prepares every bucket before a run (a real engine compiles each once)."""

    def step(self, inputs: StepInputs) -> StepOutput:
        """Runs one step."""


def bucket_arrays_are_consistent(inputs: StepInputs) -> bool:
    """Checks the shapes of `inputs` against its bucket (used by tests and engines)."""
    t, s = inputs.bucket.num_tokens, inputs.bucket.num_seqs
    return (inputs.token_ids.shape == (t,) and inputs.positions.shape == (t,)
            and inputs.slot_mapping.shape == (t,) and inputs.cu_q_lens.shape == (s + 1,)
            and inputs.kv_lens.shape == (s,) and inputs.page_indices.shape[0] == s
            and inputs.sample_indices.shape == (s,) and inputs.num_seqs.shape == (1,))
