"""A simulated engine: the real step descriptors in, placeholder tokens and a modelled time out.

`SimEngine` takes the same `StepInputs` as the JAX engine, so a policy drives
it through the same scheduler, packing and buckets. It runs no model: the
token it samples for sequence i is `kv_lens[i] % vocab_size` (arithmetic a test
can predict, as in JetStream's mock engine), and the step's seconds come from
`orca_jax.sim.cost_model`. No jax: paper-scale runs fit on a laptop.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import (
    NO_FRONT_END,
    Bucket,
    Engine,
    FrontEnd,
    PackedStep,
    StepInputs,
    StepOutput,
    bucket_arrays_are_consistent,
)
from orca_jax.sim.cost_model import (
    CostModelConfig,
    bucket_step_seconds,
    decode_span_seconds,
    real_lengths,
    step_pricer,
    step_seconds,
)

if TYPE_CHECKING:  # a hint only: the module is imported by the runs that speculate
    from orca_jax.sim.speculation import SpecConfig

# At most this many bucket objects are remembered as warm (`SimEngine._warm_seen`): a
# caller that made a new `Bucket` every step would otherwise grow the dict without end.
_WARM_SEEN_MAX = 256


class SimEngine(Engine):
    """An `Engine` whose step time is a cost model's and whose tokens are placeholders.

    Before any warm-up it prices a step in any bucket; after one, only the warm ones.
    """

    def __init__(self, config: Optional[CostModelConfig] = None,
                 speculation: Optional[SpecConfig] = None,
                 front_end: FrontEnd = NO_FRONT_END) -> None:
        self.config = config if config is not None else CostModelConfig()
        self._front_end = front_end  # the serving path its profile puts before it
        self._warm_buckets: Optional[frozenset[Bucket]] = None
        # The warm buckets met so far, by identity ({id: bucket}, holding each so its id
        # stays its own): a step's bucket is one of its `BucketConfig`'s few objects, and
        # `in` a set of dataclasses calls their Python `__hash__` and `__eq__` each step.
        self._warm_seen: dict[int, Bucket] = {}
        # `bucket_step_seconds` of this config as one call (`cost_model.step_pricer`).
        self._price = step_pricer(self.config)
        # The vocabulary as a 0-d array, for the steps' samples: read through two
        # properties and converted from a Python int on every step otherwise.
        self._vocab_0d = np.array(self.vocab_size, dtype=np.int64)
        self._vocab_size = self.vocab_size  # and as an int, for a leap's spans
        # Verifies draft tokens (docs/speculative.md) when given: acceptances drawn, the
        # draft model priced. A pipeline of stages does not speculate (yet).
        if speculation is not None:
            if self.config.pp_layers is not None:
                raise ValueError("speculative decoding (--spec_k/--draft_model/"
                                 "--spec_acceptance) is not simulated with --pp stages yet")
            if speculation.draft is not None:
                # Lazy: the caller that built `speculation` has imported its module; a run
                # that does not speculate (most) never does.
                from orca_jax.sim.speculation import check_draft
                check_draft(self.config, speculation.draft)
        self.speculation = speculation

    @property
    def front_end(self) -> FrontEnd:
        """The serving front end of the engine this simulates (`engine_profiles`)."""
        return self._front_end

    @property
    def speculates(self) -> bool:
        """Whether steps may verify draft tokens (a `SpecConfig` was given)."""
        return self.speculation is not None

    @property
    def name(self) -> str:
        return "sim"

    @property
    def needs_token_ids(self) -> bool:
        return False

    @property
    def reads_kv_pages(self) -> bool:
        """False: `step_packed` reads a step's lengths, never its pages (a pipeline's
        stages, `pp_layers`, are left to the full pool: True)."""
        return self.config.pp_layers is not None

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.vocab_size

    def _prepare(self, buckets: list[Bucket]) -> None:
        """Makes `buckets` the warm set; afterwards a step in any other bucket is an error.

        A real engine compiles each bucket here and would compile again on an
        unknown one; the simulator rejects it, so a run that passes on the
        simulator keeps the no-compile-after-warm-up invariant.

        Raises:
          ValueError: (fitted mode) a bucket has no fitted time.
        """
        table = self.config.fitted_step_s
        for bucket in buckets:
            if table is not None and bucket.num_tokens not in table:
                raise ValueError(f"SimEngine.warmup: bucket num_tokens={bucket.num_tokens} has no "
                                 f"fitted step time; fitted buckets: {sorted(table)}")
        self._warm_buckets = frozenset(buckets)
        self._warm_seen = {}

    def step(self, inputs: StepInputs) -> StepOutput:
        """Prices one step and samples `kv_lens[i] % vocab_size` for every sequence i.

        Raises:
          ValueError: the descriptor is inconsistent, or its bucket was not warmed up.
        """
        lengths = _check_inputs(inputs)
        if self._warm_buckets is not None:
            self._check_warm(inputs.bucket, self._warm_buckets)
        sampled = (inputs.kv_lens.astype(np.int64) % self.vocab_size).astype(np.int32)
        return StepOutput(sampled_tokens=sampled,
                          step_s=step_seconds(self.config, inputs, lengths))

    def step_packed(self, packed: PackedStep) -> StepOutput:
        """`step` of a packed step, from its lengths alone: its padded descriptor is never
        built. `pack_step` made the lengths of a checked plan, so the descriptor checks of
        `step` have nothing to find; the bucket must still be warm.

        Raises:
          ValueError: its bucket was not warmed up.
        """
        if self.config.pp_layers is not None:  # through every stage: their seconds added
            return self.step_stages(packed)[0]
        bucket = packed.bucket
        self._check_warm_bucket(bucket)
        kv_lens = packed.kv_lens
        step_s = self._price(bucket, packed.q_lens, kv_lens)
        if packed.spec_tokens is not None:
            return self._speculative_output(packed, step_s)
        sampled = np.zeros(bucket.num_seqs, dtype=np.int32)  # [S] padding samples 0 % vocab
        sampled[:kv_lens.size] = kv_lens % self._vocab_0d
        return StepOutput.plain(sampled, step_s)

    def _check_warm_bucket(self, bucket: Bucket) -> None:
        """`_check_warm` of a step's bucket where warm-up named the buckets (before it, any
        bucket goes); a warm one is remembered by identity (`_warm_seen`).

        Raises:
          ValueError: its bucket was not warmed up.
        """
        if self._warm_seen.get(id(bucket)) is bucket:  # met warm before: most steps
            return
        warm = self._warm_buckets
        if warm is None:
            return
        self._check_warm(bucket, warm)
        if len(self._warm_seen) < _WARM_SEEN_MAX:
            self._warm_seen[id(bucket)] = bucket

    def _speculative_output(self, packed: PackedStep, verify_s: float) -> StepOutput:
        """A verification step's output: the drafts accepted (drawn), the token sampled
        after them (`kv_len % vocab` of the accepted context, as any step's), and the
        drafter's seconds on top of the verification's.

        Raises:
          ValueError: this engine does not speculate, or the step names no requests.
        """
        spec_config, spec = self.speculation, packed.spec_tokens
        if spec_config is None or packed.request_ids is None or spec is None:
            raise ValueError("SimEngine.step_packed: a speculative step needs an engine "
                             "made with speculation= and the step's request_ids")
        context = packed.kv_lens - spec - 1  # [n] tokens before each one's newest token
        accepted = spec_config.accepted(packed.request_ids, context + 1, spec)
        draft_s = spec_config.draft_seconds(context, spec)
        n, bucket = spec.size, packed.bucket
        sampled = np.zeros(bucket.num_seqs, dtype=np.int32)  # [S]
        sampled[:n] = (context + 1 + accepted) % self.vocab_size
        num_accepted = np.zeros(bucket.num_seqs, dtype=np.int32)  # [S]
        num_accepted[:n] = accepted
        return StepOutput(sampled_tokens=sampled, step_s=verify_s + draft_s,
                          num_accepted=num_accepted, draft_s=draft_s)

    def estimate_step_s(self, q_lens: NDArray[np.int64],  # [n]
                        kv_lens: NDArray[np.int64],  # [n]
                        spec_tokens: Optional[NDArray[np.int64]] = None  # [n]
                        ) -> Optional[float]:
        """The cost model's seconds for a step of these sequences in the smallest warm
        bucket that holds it (its padding priced as a step's is), drafting included."""
        q_lens = np.asarray(q_lens, np.int64)
        kv_lens = np.asarray(kv_lens, np.int64)
        total, n = int(q_lens.sum()), int(q_lens.size)
        fits = [b for b in (self._warm_buckets or ())
                if b.num_tokens >= total and b.num_seqs >= n]
        bucket = min(fits) if fits else Bucket(max(total, 1), max(n, 1))
        if self.config.mode == "fitted" and not fits:
            return None
        seconds = bucket_step_seconds(self.config, bucket, lambda: (q_lens, kv_lens))
        if spec_tokens is not None and self.speculation is not None:
            spec = np.asarray(spec_tokens, np.int64)
            seconds += self.speculation.draft_seconds(kv_lens - q_lens, spec)  # before the 1st
        return seconds


    @property
    def num_stages(self) -> int:
        """Pipeline stages of the simulated replica (`CostModelConfig.pp_layers`)."""
        return self.config.num_stages

    def step_stages(self, packed: PackedStep) -> tuple[StepOutput, list[float]]:
        """`step_packed` through each pipeline stage: the output and each stage's seconds
        (`pipeline_stages.StagePricer`; one stage: the step's).

        Raises:
          ValueError: its bucket was not warmed up.
        """
        if self.config.pp_layers is None:
            return super().step_stages(packed)
        bucket = packed.bucket
        self._check_warm_bucket(bucket)
        kv_lens = packed.kv_lens
        sampled = np.zeros(bucket.num_seqs, dtype=np.int32)  # [S] padding samples 0 % vocab
        sampled[:kv_lens.size] = kv_lens % self.vocab_size
        stages = self.config.stage_pricer.seconds(bucket, lambda: (packed.q_lens, kv_lens))
        return StepOutput(sampled_tokens=sampled, step_s=math.fsum(stages)), stages

    def decode_span(self, bucket: Bucket, kv_lens: NDArray[np.int64],  # [n]
                    num_steps: int) -> tuple[NDArray[np.float64], NDArray[np.int32]]:
        """`num_steps` decode-only steps at once (`Engine.decode_span`): each step's cost
        model seconds (`cost_model.decode_span_seconds`) and its placeholder tokens, bit
        for bit those of `step_packed` one step at a time.

        Raises:
          ValueError: its bucket was not warmed up.
        """
        self._check_warm_bucket(bucket)
        kv_lens = np.asarray(kv_lens, np.int64)
        vocab_size = self._vocab_size
        if int(np.maximum.reduce(kv_lens)) + num_steps <= vocab_size:  # no length wraps
            # The lengths are the tokens, in int32 from the start (the modulo of a [k, n]
            # int64 matrix costs more than the steps' prices).
            tokens = kv_lens.astype(np.int32)[None, :]  # [1, n]
            if num_steps > 1:  # (half the leaps run one step: no steps to add)
                tokens = tokens + np.arange(num_steps, dtype=np.int32)[:, None]  # [k, n]
        else:
            lens = kv_lens[None, :] + np.arange(num_steps, dtype=np.int64)[:, None]  # [k, n]
            tokens = (lens % vocab_size).astype(np.int32)
        return decode_span_seconds(self.config, bucket, kv_lens, num_steps), tokens


def _check_inputs(inputs: StepInputs) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Rejects descriptors the cost model would misprice (and a real engine misrun);
    returns their `real_lengths` (`[num_seqs]` each), checked."""
    if not bucket_arrays_are_consistent(inputs):
        raise ValueError(f"SimEngine.step: array shapes do not match bucket {inputs.bucket} "
                         f"(token_ids {inputs.token_ids.shape}, cu_q_lens "
                         f"{inputs.cu_q_lens.shape}, kv_lens {inputs.kv_lens.shape}, "
                         f"num_seqs {inputs.num_seqs.shape})")
    num_seqs = int(inputs.num_seqs[0])
    if not 0 <= num_seqs <= inputs.bucket.num_seqs:
        raise ValueError(f"SimEngine.step: num_seqs={num_seqs} outside [0, "
                         f"{inputs.bucket.num_seqs}] of bucket {inputs.bucket}")
    cu = inputs.cu_q_lens
    if cu[0] != 0 or cu[num_seqs] > inputs.bucket.num_tokens:
        raise ValueError(f"SimEngine.step: cu_q_lens must start at 0 and end within "
                         f"{inputs.bucket.num_tokens} tokens, got cu_q_lens[0]={cu[0]}, "
                         f"cu_q_lens[num_seqs]={cu[num_seqs]}")
    q_lens, kv_lens = real_lengths(inputs)
    if np.any(q_lens < 0):
        raise ValueError(f"SimEngine.step: cu_q_lens decreases at sequence "
                         f"{int(np.argmax(q_lens < 0))}")
    short = kv_lens < q_lens
    if np.any(short):
        i = int(np.argmax(short))
        raise ValueError(f"SimEngine.step: kv_lens[{i}]={kv_lens[i]} is less than the "
                         f"sequence's {q_lens[i]} new tokens (kv_lens counts them)")
    return q_lens, kv_lens
