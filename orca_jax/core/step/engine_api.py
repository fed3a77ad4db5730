"""The contract between the host scheduler and an engine: StepInputs in, StepOutput out.

`pack_step()` (orca_jax.core.step.packing) turns a policy's StepPlan into a `StepInputs`: flat,
fixed-shape numpy arrays padded to a bucket `(T, S)`. Every engine, real or
simulated, receives exactly these arrays, so every policy drives the same
compiled steps. `build_step_inputs` (also in packing) is the one writer of the
layout below: `pack_step()`, a real engine's warm-up and the profiling grid all use it.
The scheduler hands an engine its step as a `PackedStep` (`Engine.step_packed`):
the bucket and real lengths at once, the descriptor built on first read, so an
engine that prices lengths alone (the simulator) never pays for padded arrays.

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

import abc
import dataclasses
import time
from typing import Callable, Collection, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

NULL_PAGE = 0  # page 0 is the padding target; the KV manager never allocates it


class EngineConfigError(ValueError):
    """The engine cannot be built as configured; the message names the setting (e.g. `tp`)."""


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """A compiled step shape: at most `num_tokens` tokens of at most `num_seqs` sequences.

    Buckets sort by tokens, then sequences (smallest first).
    """

    num_tokens: int  # T
    num_seqs: int  # S


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's descriptor, padded to `bucket`. All arrays are numpy, host side.

    `orca_jax.model` registers this class as a jax pytree (the arrays are its
    leaves, the bucket static), so the jitted step takes it as it is.
    """

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


class PackedStep:
    """One step as the scheduler packed it: its bucket and real lengths, and its padded
    descriptor (`inputs`), built on first use.

    An engine that prices a step from its lengths alone (the simulator) never has the
    padded arrays built; every other engine reads `inputs`, which `pack_step` builds
    with `build_step_inputs`, the one builder of descriptors, from copies taken at
    packing (so it is the same whenever it is first read).

    Attributes:
      bucket: the step shape it is padded to.
      q_lens: `[n]` new tokens of each real sequence (>= 1).
      kv_lens: `[n]` tokens each real sequence attends to (its cache after the step).
      build_s: seconds building the descriptor took (0 while unbuilt): host work,
        which the scheduler counts as such wherever an engine asked for it.
      request_ids: `[n]` the request index of each real sequence (None: not given, a
        warm-up or a test); an engine keys per-request randomness on it (the
        simulator's acceptance draws).
      spec_tokens: `[n]` draft tokens each sequence verifies (speculative decoding;
        None: no sequence speculates). Sequence i with k = spec_tokens[i] > 0 is a
        decode whose `q_lens[i]` = k + 1: its first query is the request's newest
        token, the next k are draft positions whose token ids in `inputs` are
        placeholders (0) the engine's drafter fills; `kv_lens[i]` counts all k + 1.
        The engine answers with `StepOutput.num_accepted`.
    """

    __slots__ = ("bucket", "q_lens", "kv_lens", "build_s", "_build", "_inputs",
                 "request_ids", "spec_tokens")

    def __init__(self, bucket: Bucket, q_lens: NDArray[np.int64],  # [n]
                 kv_lens: NDArray[np.int64],  # [n]
                 build: Callable[[], "StepInputs"],
                 request_ids: Optional[NDArray[np.int64]] = None,  # [n]
                 spec_tokens: Optional[NDArray[np.int64]] = None) -> None:  # [n]
        self.bucket = bucket
        self.q_lens = q_lens
        self.kv_lens = kv_lens
        self.build_s = 0.0
        self._build = build
        self._inputs: Optional[StepInputs] = None
        self.request_ids = request_ids
        self.spec_tokens = spec_tokens

    @property
    def inputs(self) -> "StepInputs":
        """The padded descriptor (built on the first read, then kept)."""
        if self._inputs is None:
            start = time.perf_counter()
            self._inputs = self._build()
            self.build_s = time.perf_counter() - start
        return self._inputs

    def close(self) -> None:
        """Its descriptor can no longer be built: the state it reads at its first read (the
        page table's rows, which `pack_step` takes then rather than copying every step)
        is about to change. The scheduler closes each step at its update; an engine reads
        the descriptor within the step, before that."""
        if self._inputs is None:
            self._build = _closed


def _closed() -> "StepInputs":
    raise RuntimeError("PackedStep.inputs: the step was updated before its descriptor was "
                       "read (an engine reads it within the step, before update)")


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What an engine returns for one step.

    With speculative decoding (`PackedStep.spec_tokens`), sequence i verified k_i draft
    tokens: the engine accepted the first `num_accepted[i]` (0..k_i) of them, and
    `sampled_tokens[i]` is the token the target sampled after those (the correction
    or bonus token), so the request gains `num_accepted[i] + 1` tokens, in order
    `accepted_tokens[i, :num_accepted[i]]` then `sampled_tokens[i]`. The scheduler
    advances it by that many and frees the pages past its new length.
    """

    sampled_tokens: NDArray[np.int32]  # [S] token sampled for each sequence (padding: any)
    step_s: float  # seconds the step took (measured, profiled, or from a cost model)
    # [S] draft tokens accepted per sequence (0 where it drafted none); None: no
    # sequence of the step speculated (every request gains its one sampled token).
    num_accepted: Optional[NDArray[np.int32]] = None
    # [S, K] the accepted draft token ids, row i valid in its first num_accepted[i]
    # columns (K >= the step's largest k); None for an engine without token values
    # (the simulator) or a step without speculation.
    accepted_tokens: Optional[NDArray[np.int32]] = None
    draft_s: float = 0.0  # seconds of step_s the drafter took (0: no drafting)
    # [T] the token after every row (greedy, or drawn with the key its position's token
    # would have without speculation): an engine that verifies speculative drafts
    # returns it (`JaxEngine(verify_rows=True)`); None otherwise.
    row_tokens: Optional[NDArray[np.int32]] = None

    @classmethod
    def plain(cls, sampled_tokens: NDArray[np.int32],  # [S]
              step_s: float) -> StepOutput:
        """`StepOutput(sampled_tokens=..., step_s=...)`, every other field its default:
        the fields go into the instance's dict at once, not through the frozen
        `__init__`'s `object.__setattr__` each (the simulator makes one every step)."""
        output = object.__new__(cls)
        fields = output.__dict__
        fields.update(_OUTPUT_DEFAULTS)
        fields["sampled_tokens"] = sampled_tokens
        fields["step_s"] = step_s
        return output


# `StepOutput.plain`'s fields besides the two it is given: each default, as declared.
_OUTPUT_DEFAULTS = {field.name: field.default for field in dataclasses.fields(StepOutput)
                    if field.name not in ("sampled_tokens", "step_s")}
# A field added later without a plain default (none, or a factory) would be left unset by
# `plain`: refused here, at import, rather than missing from every simulated step.
assert dataclasses.MISSING not in _OUTPUT_DEFAULTS.values(), (
    "StepOutput.plain sets only plain defaults; give the new field one or set it there")


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """How requests reach an engine's scheduler: the serving stack in front of the engine.

    A real serving engine (vLLM's) answers a client through an HTTP server, a tokenizer
    and inter-process hops on the way in, and a detokenizer and a stream on the way
    out; and it may plan step N+1 while step N runs (vLLM's async scheduling, on by
    default since 0.14), so a request reaching its queue during step N first runs in
    step N+2. The scheduler honours both (`Scheduler.next_arrival_s`, its arrivals'
    join): a request joins the queue `delay_s` after its arrival, and with
    `plans_ahead` only at the plan after the one that follows, unless the engine was
    idle (nothing running: the plan starts at once, as an idle vLLM does).

    Attributes:
      delay_s: seconds of the front end's per-request path, in and out, counted once
        on the way in (a client's latencies hold both ways alike).
      plans_ahead: the engine plans each step while the one before runs.
    """

    delay_s: float = 0.0
    plans_ahead: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.delay_s, (int, float)) and 0.0 <= self.delay_s < float("inf")):
            raise ValueError(f"FrontEnd.delay_s must be finite and >= 0, got {self.delay_s!r}")


NO_FRONT_END = FrontEnd()  # requests join at their arrival; each plan made when it runs


class PendingStep(abc.ABC):
    """A dispatched step whose sampled tokens may still be on the device.

    `Engine.step_async` returns one, so the host can plan and pack the next step
    while this one runs (overlap scheduling); `output()` waits for the tokens.
    """

    @property
    @abc.abstractmethod
    def step_s(self) -> float:
        """The step's seconds: known at dispatch for a clock that prices the
        descriptor, else (a measured wall clock) after waiting for the step."""

    @abc.abstractmethod
    def output(self) -> StepOutput:
        """Waits for the step and returns its output (the same value on every call)."""


class FinishedStep(PendingStep):
    """A step that already ran: an engine without asynchronous steps returns this."""

    def __init__(self, output: StepOutput) -> None:
        self._output = output

    @property
    def step_s(self) -> float:
        return self._output.step_s

    def output(self) -> StepOutput:
        return self._output


class Engine(abc.ABC):
    """What the scheduler needs of an engine; `JaxEngine` and `SimEngine` are ones.

    `warmup()` checks the buckets, then hands them to the engine's `_prepare`
    (a real engine compiles each there); `step()` runs one descriptor, and an
    engine calls `_check_warm` first so a bucket warm-up did not prepare is
    refused rather than compiled mid-run.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Short name written to results (`sim`, `jax`)."""

    @property
    @abc.abstractmethod
    def needs_token_ids(self) -> bool:
        """Whether `StepInputs.token_ids` must hold real ids (a simulator needs none)."""

    def warmup(self, buckets: Sequence[Bucket]) -> None:
        """Prepares every bucket before a run (a real engine compiles each once).

        Raises:
          ValueError: no buckets, or one is not a `Bucket` of at least one token
            and one sequence (named by its index), or the engine cannot take one.
        """
        where = f"{type(self).__name__}.warmup"
        buckets = list(buckets)
        if not buckets:
            raise ValueError(f"{where}: no buckets given")
        for index, bucket in enumerate(buckets):
            if not isinstance(bucket, Bucket):
                raise ValueError(f"{where}: buckets[{index}] is {bucket!r}, not a Bucket")
            if bucket.num_tokens < 1 or bucket.num_seqs < 1:
                raise ValueError(f"{where}: buckets[{index}] = {bucket} needs "
                                 "num_tokens >= 1 and num_seqs >= 1")
        self._prepare(buckets)

    @abc.abstractmethod
    def _prepare(self, buckets: list[Bucket]) -> None:
        """Readies the checked `buckets` for `step` (compiles, or records them)."""

    @abc.abstractmethod
    def step(self, inputs: StepInputs) -> StepOutput:
        """Runs one step."""

    def step_packed(self, packed: PackedStep) -> StepOutput:
        """Runs one step the scheduler packed: by default its descriptor through `step`.

        An engine that needs only the step's lengths overrides this, and the padded
        descriptor is never built (the simulator).
        """
        return self.step(packed.inputs)

    def decode_span(self, bucket: Bucket, kv_lens: NDArray[np.int64],  # [n]
                    num_steps: int) -> Optional[tuple[NDArray[np.float64], NDArray[np.int32]]]:
        """Runs `num_steps` decode-only steps of the same `n` sequences in `bucket` at once,
        step j (from 0) attending to `kv_lens + j` tokens (its new token included): what a
        leaping executor asks (`orca_jax.core.loop.leap`) instead of `num_steps` calls of
        `step_packed`.

        Returns:
          `(step seconds [num_steps], sampled tokens [num_steps, n])`, bit for bit what
          `step_packed` gives for each of those steps one by one; or None (the default):
          this engine runs every step (a real engine, an engine that records its steps),
          and an executor never leaps over its steps.
        """
        del bucket, kv_lens, num_steps
        return None

    @property
    def front_end(self) -> FrontEnd:
        """How requests reach this engine's scheduler (`FrontEnd`). `NO_FRONT_END` (the
        default): at their arrival, each step planned when it runs."""
        return NO_FRONT_END

    @property
    def speculates(self) -> bool:
        """Whether a step may verify draft tokens (`PackedStep.spec_tokens` > 0), each
        answered with `StepOutput.num_accepted`. False (the default): a plan with
        `spec_tokens` > 0 breaks rule `spec_unsupported`."""
        return False

    def estimate_step_s(self, q_lens: NDArray[np.int64],  # [n]
                        kv_lens: NDArray[np.int64],  # [n]
                        spec_tokens: Optional[NDArray[np.int64]] = None  # [n]
                        ) -> Optional[float]:
        """An estimate of the seconds a step of these real sequences would take, drafting
        included (`spec_tokens`: each one's k, counted in its `q_lens` and `kv_lens`),
        read by policies through `SchedulerView.estimate_step_s` (smartspec weighs the
        goodput of each k with it). None (the default): this engine cannot say."""
        del q_lens, kv_lens, spec_tokens
        return None

    @property
    def num_stages(self) -> int:
        """Pipeline stages a step passes through, one after another (1: none). An engine
        of more prices each (`step_stages`) and runs under a pipeline executor
        (`orca_jax.core.loop.pipeline`)."""
        return 1

    def step_stages(self, packed: PackedStep) -> tuple[StepOutput, list[float]]:
        """Runs one packed step through every pipeline stage.

        Returns:
          Its output (`step_s`: the stages' seconds added, the step's latency through an
          empty pipeline) and each stage's seconds, in stage order (`num_stages` of them).
        """
        output = self.step_packed(packed)
        return output, [output.step_s]

    def dispatch_stages(self, packed: PackedStep) -> tuple[PendingStep, list[float]]:
        """`step_stages` without waiting for the step's tokens where the engine can: its
        stage seconds are known at dispatch (a clock that prices the descriptor), and
        the tokens come with the pending step's `output()`. By default the step runs
        before this returns (`step_stages`)."""
        output, stages = self.step_stages(packed)
        return FinishedStep(output), stages

    @property
    def feeds_tokens(self) -> bool:
        """Whether `step_async` takes a `token_source` (the device keeps the last step's
        sampled tokens and feeds them to the next step's decodes)."""
        return False

    def step_async(self, inputs: StepInputs,
                   token_source: Optional[NDArray[np.int32]] = None) -> PendingStep:
        """Dispatches one step without waiting for its tokens (default: runs `step`).

        Args:
          inputs: the step's descriptor.
          token_source: [T] or None; row t >= 0 means "token t of this step is the token
            sampled for sequence `token_source[t]` of the previous step dispatched on this
            engine" (its `inputs.token_ids[t]` is a placeholder); -1 means take
            `inputs.token_ids[t]`. Only an engine that `feeds_tokens` takes one.

        Raises:
          ValueError: a `token_source` given to an engine that does not feed tokens.
        """
        if token_source is not None:
            raise ValueError(f"{type(self).__name__}.step_async: this engine does not feed "
                             "sampled tokens on the device (feeds_tokens is False)")
        return FinishedStep(self.step(inputs))

    def facts(self) -> dict[str, object]:
        """What a run's summary should say of this engine (JSON values; none by default).

        A real engine reports its compiles and memory here; an engine that wraps
        another passes the wrapped one's facts through.
        """
        return {}

    @property
    def reads_kv_pages(self) -> bool:
        """Whether this engine may read which KV pages a request holds: a step's page rows
        or slot mapping, or pages named to `read_kv_pages`/`write_kv_pages`. True (the
        default, and an `EngineWrapper`'s, whose `step` may read the descriptor); False:
        it prices and answers a step from its lengths alone (the simulator), so a run the
        runner builds may keep page counts only (`orca_jax.core.kv.counted_pool`)."""
        return True

    def read_kv_pages(self, pages: NDArray[np.int32]) -> object:  # [n]
        """The KV these cache pages hold, for `write_kv_pages` of another engine of the
        same model (a disaggregated cluster's transfer). An engine without a cache (the
        simulator) returns None."""
        del pages
        return None

    def write_kv_pages(self, pages: NDArray[np.int32], kv: object) -> None:  # [n]
        """Writes `kv` from `read_kv_pages` into these pages, in order (None: nothing)."""
        del pages, kv

    def wait_kv(self) -> None:
        """Waits until every KV write dispatched so far is done (a migration's copy is
        timed by it); an engine without a cache has nothing to wait for."""

    def host_kv_store(self) -> Optional[object]:
        """Where a run's host KV tier keeps its pages, for an engine whose cache holds
        real KV: an `orca_jax.core.kv.tier_contents.PageContents` that copies pages
        between this engine's cache and host memory. None (the default, the simulator):
        the tier moves no data."""
        return None

    def _check_warm(self, bucket: Bucket, warm: Collection[Bucket]) -> None:
        """Raises ValueError naming `bucket` and the `warm` ones if it is not among them."""
        if bucket not in warm:
            raise ValueError(f"{type(self).__name__}.step: bucket {bucket} was not warmed up; "
                             f"warm buckets: {sorted(warm)}")


class EngineWrapper(Engine):
    """An engine that runs another one's steps and adds something (a record, a price).

    It answers to the wrapped engine's name, needs its token ids, reports its
    facts and warms it up; a subclass overrides `step` (and `_prepare` if it
    does more at warm-up).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def needs_token_ids(self) -> bool:
        return self.engine.needs_token_ids

    def facts(self) -> dict[str, object]:
        return self.engine.facts()

    @property
    def front_end(self) -> FrontEnd:
        return self.engine.front_end

    @property
    def speculates(self) -> bool:
        return self.engine.speculates

    def estimate_step_s(self, q_lens: NDArray[np.int64],  # [n]
                        kv_lens: NDArray[np.int64],  # [n]
                        spec_tokens: Optional[NDArray[np.int64]] = None  # [n]
                        ) -> Optional[float]:
        return self.engine.estimate_step_s(q_lens, kv_lens, spec_tokens)

    def _prepare(self, buckets: list[Bucket]) -> None:
        self.engine.warmup(buckets)

    def read_kv_pages(self, pages: NDArray[np.int32]) -> object:  # [n]
        return self.engine.read_kv_pages(pages)

    def write_kv_pages(self, pages: NDArray[np.int32], kv: object) -> None:  # [n]
        self.engine.write_kv_pages(pages, kv)

    def wait_kv(self) -> None:
        self.engine.wait_kv()

    def host_kv_store(self) -> Optional[object]:
        return self.engine.host_kv_store()


def bucket_arrays_are_consistent(inputs: StepInputs) -> bool:
    """Checks the shapes of `inputs` against its bucket (used by tests and engines)."""
    t, s = inputs.bucket.num_tokens, inputs.bucket.num_seqs
    return (inputs.token_ids.shape == (t,) and inputs.positions.shape == (t,)
            and inputs.slot_mapping.shape == (t,) and inputs.cu_q_lens.shape == (s + 1,)
            and inputs.kv_lens.shape == (s,) and inputs.page_indices.shape[0] == s
            and inputs.sample_indices.shape == (s,) and inputs.num_seqs.shape == (1,))
