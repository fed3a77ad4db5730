"""Speculative decoding on the real engine: drafters, and exact verification by the target.

`SpeculativeEngine` wraps a `JaxEngine` compiled with `verify_rows` (the target). A step
whose `PackedStep.spec_tokens` gives sequence i k > 0 draft tokens packs k + 1 query rows
for it (its newest token, then k placeholders); here the drafter fills the placeholders,
the target runs the whole ragged step once and returns its greedy token after every row,
and `accept_greedy` keeps the draft's longest prefix that the target agrees with plus
the target's next token. So a greedy run's outputs are exactly those without speculation
(and a sampled run's: below).

Drafters:
  * `ngram`: prompt lookup (`verification.ngram_draft`) over the request's tokens, which
    this engine keeps from the descriptors it runs (no model, no device time).
  * `model`: a smaller model of the same vocabulary, a second `JaxEngine` with its own KV
    cache of the target's page geometry. It runs every step the target runs on the same
    descriptor (its KV stays in step with the target's through prefills, preemptions and
    prefix hits), and before a speculating step k decode steps of one token per drafting
    sequence, on the same page rows. Its steps are compiled for the run's buckets, once,
    counted (`facts`), and their time is in the step's `step_s` (and `draft_s`).

Sampling at temperature > 0: the target's token at each verified row is drawn inside the
compiled step with the key that row's position has without speculation (`llama.sample_rows`),
and a draft is kept while it equals that draw. For prompt lookup (a deterministic draft,
q one-hot) this is standard speculative rejection sampling exactly: the draft x is kept
with probability p(x), and a rejection's token is a draw from p given it is not x, i.e.
p with x removed and renormalised (`verification.rejection_sample` with one-hot rows). For
the draft model, which samples its drafts with the same per-position keys, it is the
Gumbel-max coupling of draft and target (drafter-invariant speculative decoding, Daliri
et al. 2024): every kept token is the one sampling without speculation draws, so the
output is the target's distribution exactly (indeed the same tokens, seed for seed), and
a draft is accepted with probability at least (1 - TV) / (1 + TV), against 1 - TV for
min(1, p/q) acceptance. Both stay in the one compiled program per bucket.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import numpy as np
from flax import nnx
from numpy.typing import NDArray

from orca_jax.core.step.engine_api import (
    Bucket,
    EngineConfigError,
    EngineWrapper,
    PackedStep,
    StepInputs,
    StepOutput,
)
from orca_jax.core.step.packing import SamplingArrays, build_step_inputs
from orca_jax.core.step.verification import DRAFTERS, accept_greedy, ngram_draft
from orca_jax.model import weights
from orca_jax.model.engine import JaxEngine
from orca_jax.specs.model_config import ModelConfig

_NO_DRAFT = -1  # a draft row the drafter proposed nothing for: never equals a target token


def check_draft_model(target: ModelConfig, draft: ModelConfig) -> None:
    """Raises EngineConfigError (one line naming both) unless `draft` can draft for `target`:
    the same vocabulary, since a draft token must be a target token id."""
    if draft.vocab_size != target.vocab_size:
        raise EngineConfigError(f"draft model {draft.name!r} has vocab_size {draft.vocab_size}, "
                                f"target {target.name!r} has {target.vocab_size}: a draft model "
                                "needs the target's vocabulary")


def draft_params(target: ModelConfig, target_params: nnx.State, draft: ModelConfig, *,
                 seed: int) -> nnx.State:
    """The draft model's parameters.

    A draft of the target's shapes with fewer layers (a preset `<target>-draft`) takes the
    target's embedding, first layers, final norm and head (a layer-skip self-draft, as
    LayerSkip and Draft & Verify do): with random weights it is the only draft that agrees
    with the target often enough to test acceptance. Any other draft is initialised from
    `seed`.
    """
    check_draft_model(target, draft)
    same_shapes = dataclasses.replace(draft, name=target.name, num_layers=target.num_layers,
                                      max_context=target.max_context) == target
    params = weights.init_params(draft, seed=seed)
    if not same_shapes or draft.num_layers > target.num_layers:
        return params
    source = {jax.tree_util.keystr(path): leaf
              for path, leaf in jax.tree_util.tree_leaves_with_path(target_params)}
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: source.get(jax.tree_util.keystr(path), leaf), params)


class SpeculativeEngine(EngineWrapper):
    """A target `JaxEngine` (built with `verify_rows=True`) that verifies draft tokens.

    Args:
      target: the target engine.
      drafter: `ngram` or `model`.
      draft: the draft engine (`drafter="model"`): a `JaxEngine` of a model with the
        target's vocabulary and the target's page size, cache pages and page-table width.
      max_ngram: the longest suffix the `ngram` drafter looks up.

    Raises:
      EngineConfigError: an unknown drafter, a model drafter without a draft engine (or
        an ngram one with one), a target not compiled to verify, or a draft of another
        vocabulary or page geometry; each one line.
    """

    def __init__(self, target: JaxEngine, *, drafter: str,
                 draft: Optional[JaxEngine] = None, max_ngram: int = 3) -> None:
        if drafter not in DRAFTERS:
            raise EngineConfigError(f"drafter {drafter!r} is not one of {', '.join(DRAFTERS)}")
        if (drafter == "model") != (draft is not None):
            raise EngineConfigError("drafter 'model' needs a draft model (--draft_model)"
                                    if draft is None else
                                    f"drafter {drafter!r} runs no draft model; drop "
                                    "--draft_model or use --drafter=model")
        if not target._verify:
            raise EngineConfigError("SpeculativeEngine: the target JaxEngine must be built "
                                    "with verify_rows=True")
        if draft is not None:
            check_draft_model(target.model_config, draft.model_config)
            geometry = (target.page_size, target.num_cache_pages, target.pages_per_seq)
            if (draft.page_size, draft.num_cache_pages, draft.pages_per_seq) != geometry:
                raise EngineConfigError(
                    f"draft engine pages (page_size, num_cache_pages, pages_per_seq) = "
                    f"{(draft.page_size, draft.num_cache_pages, draft.pages_per_seq)} differ "
                    f"from the target's {geometry}: the draft writes the target's page rows")
        super().__init__(target)
        self.target = target
        self.drafter = drafter
        self.draft = draft
        self.max_ngram = max_ngram
        self._buckets: list[Bucket] = []
        self._seconds: dict[Bucket, tuple[float, float]] = {}  # bucket -> (target, draft) s
        self._contexts: dict[int, NDArray[np.int32]] = {}  # request -> its tokens seen
        self._lengths: dict[int, int] = {}  # request -> tokens of its context known
        self._draft_s = 0.0
        self._num_draft_steps = 0
        self._num_drafted = 0
        self._num_accepted = 0

    @property
    def speculates(self) -> bool:
        return True

    @property
    def num_compiles(self) -> int:
        """XLA compilations of the target and the draft model together."""
        return self.target.num_compiles + (self.draft.num_compiles if self.draft else 0)

    def facts(self) -> dict[str, object]:
        """The target's facts, `num_compiles` counting the draft's too, and the drafting:
        drafter, draft model and its compiles, draft steps and seconds, tokens drafted
        and accepted."""
        facts = dict(self.target.facts())
        facts.update(
            num_compiles=self.num_compiles, target_num_compiles=self.target.num_compiles,
            drafter=self.drafter, draft_steps=self._num_draft_steps,
            draft_s=round(self._draft_s, 6), drafted_tokens=self._num_drafted,
            accepted_draft_tokens=self._num_accepted)
        if self.draft is not None:
            draft = self.draft.facts()
            facts.update(draft_model=self.draft.model_config.name,
                         draft_num_compiles=draft["num_compiles"],
                         draft_compile_s=draft["compile_s"])
        return facts

    def _prepare(self, buckets: list[Bucket]) -> None:
        self._buckets = sorted(set(buckets))
        self.target.warmup(buckets)
        if self.draft is not None:  # the same step shapes: the draft runs the same descriptors
            self.draft.warmup(buckets)
        for bucket in self._buckets:  # what `estimate_step_s` reads: compiled, no new shape
            if bucket not in self._seconds:
                self._seconds[bucket] = (_time_step(self.target, bucket),
                                         _time_step(self.draft, bucket) if self.draft else 0.0)

    def estimate_step_s(self, q_lens: NDArray[np.int64],  # [n]
                        kv_lens: NDArray[np.int64],  # [n]
                        spec_tokens: Optional[NDArray[np.int64]] = None  # [n]
                        ) -> Optional[float]:
        """A step's seconds from each bucket's time measured at warm-up (dummy steps of the
        bucket's full shape): the target's step in the bucket of its tokens (draft
        positions included in `q_lens`), the draft model's mirror of it, and its draft
        decode steps (step j of the sequences drafting more than j tokens). The
        prompt-lookup drafter costs no device time. None before warm-up."""
        del kv_lens  # the measured buckets are full ones: the bucket decides the estimate
        if not self._seconds:
            return None
        total = int(q_lens.sum())
        bucket = next((b for b in self._buckets if b.num_tokens >= total), None)
        if bucket is None:
            return None
        target_s, draft_s = self._seconds[bucket]
        seconds = target_s + draft_s
        if self.draft is not None and spec_tokens is not None and spec_tokens.any():
            for j in range(int(spec_tokens.max())):
                seconds += self._seconds[self._bucket_for(int((spec_tokens > j).sum()))][1]
        return seconds

    def host_kv_store(self) -> Optional[object]:
        if self.draft is not None:  # pages loaded from host would miss the draft's cache
            raise EngineConfigError("a host KV tier with a draft model is not built (the "
                                    "draft's cache would miss the pages it loads); use "
                                    "--drafter=ngram")
        return self.target.host_kv_store()

    def step(self, inputs: StepInputs) -> StepOutput:
        """A step without speculation (the draft model mirrors it)."""
        return self._run(inputs, None, None)

    def step_packed(self, packed: PackedStep) -> StepOutput:
        return self._run(packed.inputs, packed.request_ids, packed.spec_tokens)

    def _run(self, inputs: StepInputs, request_ids: Optional[NDArray[np.int64]],  # [n]
             spec: Optional[NDArray[np.int64]]) -> StepOutput:  # [n]
        cu = inputs.cu_q_lens  # [S + 1]
        if spec is not None and not spec.any():
            spec = None
        if self.drafter == "ngram" and request_ids is not None:
            self._remember(inputs, request_ids, spec)
        draft_s = 0.0
        drafts = None
        if spec is not None:
            start = time.perf_counter()
            drafts = (self._model_drafts(inputs, spec) if self.draft is not None
                      else self._ngram_drafts(inputs, request_ids, spec))  # [n, K]
            draft_s = time.perf_counter() - start
            token_ids = inputs.token_ids.copy()  # [T] a new array: the descriptor is shared
            for i in np.flatnonzero(spec).tolist():
                row = drafts[i, :spec[i]]
                token_ids[cu[i] + 1:cu[i] + 1 + spec[i]] = np.maximum(row, 0)  # pad: any id
            inputs = dataclasses.replace(inputs, token_ids=token_ids)
        start = time.perf_counter()
        pending = self.target.step_async(inputs)
        mirror = self.draft.step_async(inputs) if self.draft is not None else None
        output = pending.output()
        if mirror is not None:
            mirror.output()
        step_s = time.perf_counter() - start + draft_s
        if mirror is not None:  # the mirror step keeps the draft's KV; it is draft work too
            draft_s += mirror.step_s
        self._draft_s += draft_s
        if spec is None:
            return StepOutput(sampled_tokens=output.sampled_tokens, step_s=step_s,
                              draft_s=draft_s)
        assert drafts is not None and output.row_tokens is not None
        sampled = output.sampled_tokens.copy()  # [S]
        num_accepted = np.zeros(sampled.shape[0], np.int32)  # [S]
        accepted = np.zeros((sampled.shape[0], drafts.shape[1]), np.int32)  # [S, K]
        for i in np.flatnonzero(spec).tolist():
            k = int(spec[i])
            kept = accept_greedy(drafts[i, :k], output.row_tokens[cu[i]:cu[i] + k + 1])
            num_accepted[i] = kept.size - 1
            accepted[i, :kept.size - 1] = kept[:-1]
            sampled[i] = kept[-1]
            if self.drafter == "ngram" and request_ids is not None:
                # Its context gains the drafts it keeps, after its newest token.
                self._write(int(request_ids[i]), int(inputs.positions[cu[i]]),
                            np.concatenate([inputs.token_ids[cu[i]:cu[i] + 1], kept[:-1]]))
        self._num_drafted += int((drafts >= 0).sum())
        self._num_accepted += int(num_accepted.sum())
        return StepOutput(sampled_tokens=sampled, step_s=step_s, num_accepted=num_accepted,
                          accepted_tokens=accepted, draft_s=draft_s)

    def request_tokens(self, request: int) -> NDArray[np.int32]:  # -> [L]
        """The tokens of request `request` this engine has seen in its steps, and the
        drafts it kept: the prompt-lookup drafter's context (its newest token, never
        computed, excluded). Empty for a request it never ran, or a model drafter."""
        context = self._contexts.get(request)
        return np.zeros(0, np.int32) if context is None else context[:self._lengths[request]]

    def _remember(self, inputs: StepInputs, request_ids: NDArray[np.int64],  # [n]
                  spec: Optional[NDArray[np.int64]]) -> None:  # [n]
        """Writes the step's known tokens into each request's context (a speculating
        request's drafts are not known yet: only its first row), cut at its end."""
        cu, positions, tokens = inputs.cu_q_lens, inputs.positions, inputs.token_ids
        for i, request in enumerate(request_ids.tolist()):
            first, last = int(cu[i]), int(cu[i + 1])
            if spec is not None and spec[i] > 0:
                last = first + 1
            self._write(request, int(positions[first]), tokens[first:last])

    def _write(self, request: int, start: int, tokens: NDArray[np.int32]) -> None:  # [m]
        """Writes a request's tokens from position `start` on; its context ends after them
        (positions past are stale: an earlier run of this index, or a recompute)."""
        end = start + tokens.shape[0]
        context = self._contexts.get(request)
        if context is None or context.shape[0] < end:
            grown = np.zeros(max(end, 2 * (0 if context is None else context.shape[0])),
                             np.int32)
            if context is not None:
                grown[:context.shape[0]] = context
            context = grown
        context[start:end] = tokens
        context[end:] = 0
        self._contexts[request] = context
        self._lengths[request] = end

    def _ngram_drafts(self, inputs: StepInputs, request_ids: Optional[NDArray[np.int64]],
                      spec: NDArray[np.int64]) -> NDArray[np.int32]:  # [n] -> [n, K]
        """Each speculating request's prompt-lookup draft, `_NO_DRAFT` past its proposal."""
        drafts = np.full((spec.shape[0], int(spec.max())), _NO_DRAFT, np.int32)
        if request_ids is None:
            return drafts
        for i in np.flatnonzero(spec).tolist():
            request = int(request_ids[i])
            context = self._contexts[request][:self._lengths[request]]
            proposal = ngram_draft(context, int(spec[i]), max_ngram=self.max_ngram)
            drafts[i, :proposal.size] = proposal
        return drafts

    def _model_drafts(self, inputs: StepInputs,
                      spec: NDArray[np.int64]) -> NDArray[np.int32]:  # [n] -> [n, K]
        """k decode steps of the draft model for each speculating sequence: step j feeds
        its (j-1)-th draft (the newest token for j = 1) at the position after it."""
        assert self.draft is not None
        cu = inputs.cu_q_lens
        rows = np.flatnonzero(spec)  # [m] the drafting sequences
        first = cu[rows]  # [m] the flat row of each one's newest token
        current = inputs.token_ids[first].astype(np.int32)  # [m]
        position = inputs.positions[first].astype(np.int64)  # [m]
        sampling = SamplingArrays(temperature=inputs.temperature, top_k=inputs.top_k,
                                  top_p=inputs.top_p, rng_seeds=inputs.rng_seeds)
        drafts = np.full((spec.shape[0], int(spec.max())), _NO_DRAFT, np.int32)
        for j in range(int(spec.max())):
            live = spec[rows] > j  # [m] still drafting
            seqs = rows[live]
            step = build_step_inputs(
                self._bucket_for(seqs.size), num_tokens=np.ones(seqs.size, np.int64),
                num_computed=position[live] + j, page_rows=inputs.page_indices[seqs],
                page_size=self.draft.page_size, token_ids=current[live],
                sampling=sampling, sampling_rows=seqs)
            out = self.draft.step(step)
            self._num_draft_steps += 1
            current[live] = out.sampled_tokens[:seqs.size]
            drafts[seqs, j] = current[live]
        return drafts

    def _bucket_for(self, num_seqs: int) -> Bucket:
        """The smallest warm bucket holding `num_seqs` one-token sequences."""
        for bucket in self._buckets:
            if bucket.num_tokens >= num_seqs and bucket.num_seqs >= num_seqs:
                return bucket
        raise ValueError(f"SpeculativeEngine: no warm bucket holds {num_seqs} drafting "
                         f"sequences (buckets {self._buckets})")


def _time_step(engine: JaxEngine, bucket: Bucket, repeats: int = 3) -> float:
    """The median wall seconds of `repeats` dummy steps of `bucket` (already compiled)."""
    inputs = engine._dummy_inputs(bucket)
    return float(np.median([engine.step(inputs).step_s for _ in range(repeats)]))
