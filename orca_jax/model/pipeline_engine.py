"""The real engine in pipeline stages: the model's layers split over P groups of devices.

`PipelinedJaxEngine` runs the same paged step as `JaxEngine`, cut at layer boundaries
(`orca_jax.sim.pipeline_stages.stage_layers` gives the split). Stage `s` lives on its own
`tp` devices, `[s tp, (s + 1) tp)` of `jax.devices()` (`sharding.stage_meshes`), and holds
only its own part of the model and of the KV cache:

* stage 0: the embedding and its layers;
* a middle stage: its layers;
* the last stage: its layers, the final norm and the LM head (the embedding's copy when
  the head is tied), and sampling.

Each stage's cache holds its own layers' pages (the same page numbers on every stage: a
page is one request's tokens, in each stage's layers). Each stage is one compiled program
per bucket (its cache donated, updated in place); the step descriptor goes to every stage
(replicated over its devices), and the `[T, d_model]` activations go from a stage's
devices to the next's by `jax.device_put`. Within a stage, tensor parallelism is
`JaxEngine`'s: the Megatron layout over the stage's `tp` mesh.

Nothing waits between stages: `step_async` enqueues every stage's program and returns,
and JAX runs them as their inputs arrive, so a step dispatched next runs its stage 0
while this one runs its stage 1 (micro-batches in flight, `orca_jax.core.loop.pipeline`).
Each stage's cache chains its steps in dispatch order on its devices, so a stage never
runs a later micro-batch before an earlier one. `step_stages` is the measuring path: it
waits for each stage in turn and times it (the wall clock's stage seconds).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.core.step.engine_api import (
    Bucket,
    Engine,
    EngineConfigError,
    PackedStep,
    PendingStep,
    StepInputs,
    StepOutput,
    bucket_arrays_are_consistent,
)
from orca_jax.model import compile_cache, sharding
from orca_jax.model import llama as model_lib
from orca_jax.model.engine import (
    JaxEngine,
    _DispatchedStep,
    backend_compiles,
    compile_counted,
    dummy_inputs,
    hlo_fingerprint,
    warm_up_buckets,
)
from orca_jax.specs.model_config import ModelConfig

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Graphs:
    """The graph definitions of the model's parts a stage merges its parameters into."""

    embed: nnx.GraphDef
    layer: nnx.GraphDef  # every decoder layer has the same graph
    norm: nnx.GraphDef
    head: nnx.GraphDef  # lm_head's, or the embedding's when tied
    tied: bool


def _stage_parts(tree: Any, first: bool, last: bool, start: int, stop: int,
                 tied: bool) -> dict[str, Any]:
    """The parts of a parameter-shaped tree (values or shardings) stage [start, stop) holds."""
    parts: dict[str, Any] = {"layers": tuple(tree["layers"][i] for i in range(start, stop))}
    if first:
        parts["embed"] = tree["embed_tokens"]
    if last:
        parts["norm"] = tree["norm"]
        parts["head"] = tree["embed_tokens"] if tied else tree["lm_head"]
    return parts


def _stage_step(graphs: _Graphs, attend: Any, config: ModelConfig, first: bool, last: bool,
                params: dict[str, Any], cache: model_lib.KVCache,
                x: Optional[jax.Array],  # [T, d_model] from the stage before (None: first)
                inputs: StepInputs) -> tuple[model_lib.KVCache, Any]:
    """One stage of `model_lib.step`: returns its cache and the activations for the next
    stage, or (the last) the `StepResult`."""
    if first:
        x = nnx.merge(graphs.embed, params["embed"])(inputs.token_ids)  # [T, d_model]
    assert x is not None
    layers = [nnx.merge(graphs.layer, layer) for layer in params["layers"]]
    x, cache = model_lib.decoder_layers(layers, cache, x, inputs, attend, config)
    if not last:
        return cache, x
    norm = nnx.merge(graphs.norm, params["norm"])
    head = nnx.merge(graphs.head, params["head"])
    embed, lm_head = (head, None) if graphs.tied else (None, head)
    return cache, model_lib.sample_rows(
        lambda rows: model_lib.lm_logits(norm, embed, lm_head, rows), x, inputs)


@dataclasses.dataclass
class _Stage:
    """One pipeline stage: its devices, parameters, cache and compiled programs."""

    index: int
    layers: tuple[int, int]  # [start, stop) of the model's layers
    mesh: jax.sharding.Mesh
    params: dict[str, Any]
    cache: model_lib.KVCache  # its layers' pages only
    inputs_sharding: jax.sharding.NamedSharding  # replicated over its devices
    jitted: Any
    compiled: dict[Bucket, jax.stages.Compiled] = dataclasses.field(default_factory=dict)
    fingerprints: dict[Bucket, str] = dataclasses.field(default_factory=dict)
    num_compiles: int = 0


class PipelinedJaxEngine(Engine):
    """`JaxEngine`'s step in `len(stage_layers)` pipeline stages (see the module docstring).

    Args:
      model_config: the model's shapes.
      params: the whole model's parameter state (as `JaxEngine` takes it); each stage
        keeps its own part, on its devices.
      stage_layers: layers of each stage, in order, summing to the model's layers
        (`orca_jax.sim.pipeline_stages.stage_layers`).
      num_cache_pages: pages in each stage's KV cache, the null page 0 included.
      page_size: tokens per page.
      pages_per_seq: page-table width of every bucket.
      dtype: parameter, activation and KV cache dtype.
      attention: the attention op (`JaxEngine`'s choices).
      warmup_kv_len: the warm-up's dummy context length (None: the page-table width).
      tp: devices of each stage (tensor parallelism inside it).
      devices: the devices to use, stage 0's first (default `jax.devices()`).

    Raises:
      EngineConfigError: the stages do not cover the model's layers, or `pp x tp`
        devices are more than JAX sees, or `tp` does not divide the model.
    """

    def __init__(self, model_config: ModelConfig, params: nnx.State, *,
                 stage_layers: Sequence[int], num_cache_pages: int, page_size: int,
                 pages_per_seq: int, dtype: jnp.dtype = jnp.float32,
                 attention: str = "reference", warmup_kv_len: Optional[int] = None,
                 tp: int = 1, devices: Optional[Sequence[jax.Device]] = None) -> None:
        stage_layers = tuple(stage_layers)
        if min(stage_layers, default=0) < 1 or sum(stage_layers) != model_config.num_layers:
            raise EngineConfigError(f"PipelinedJaxEngine: stage_layers {stage_layers} must be "
                                    f"integers >= 1 summing to model {model_config.name!r}'s "
                                    f"{model_config.num_layers} layers")
        if num_cache_pages < 2 or page_size < 1 or pages_per_seq < 1:
            raise ValueError(f"PipelinedJaxEngine: needs num_cache_pages >= 2, page_size >= 1, "
                             f"pages_per_seq >= 1; got {num_cache_pages}, {page_size}, "
                             f"{pages_per_seq}")
        max_len = pages_per_seq * page_size
        if warmup_kv_len is not None and not 1 <= warmup_kv_len <= max_len:
            raise ValueError(f"PipelinedJaxEngine: warmup_kv_len={warmup_kv_len} must be in "
                             f"[1, {max_len}]")
        attend = model_lib.attention_op(attention)
        meshes = sharding.stage_meshes(len(stage_layers), tp, model_config, devices)
        self.model_config = model_config
        self.stage_layers = stage_layers
        self.num_cache_pages, self.page_size = num_cache_pages, page_size
        self.pages_per_seq = pages_per_seq
        self.warmup_kv_len = warmup_kv_len if warmup_kv_len is not None else max_len
        self.dtype = jnp.dtype(dtype)
        self.attention = attention
        self._tp = tp
        self._multiprocess = False  # read by `_DispatchedStep`: stages live on one process
        _, abstract = model_lib.abstract_model(model_config, self.dtype)
        JaxEngine._check_params(abstract, params)
        params = jax.tree.map(
            lambda a: a.astype(self.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
        model = nnx.eval_shape(lambda: model_lib.init_model(model_config, dtype=self.dtype))
        tied = model.lm_head is None
        graphs = _Graphs(embed=nnx.split(model.embed_tokens)[0],
                         layer=nnx.split(model.layers[0])[0], norm=nnx.split(model.norm)[0],
                         head=nnx.split(model.embed_tokens if tied else model.lm_head)[0],
                         tied=tied)
        stage_config = functools.partial(dataclasses.replace, model_config)
        self._stages: list[_Stage] = []
        start = 0
        for s, (count, mesh) in enumerate(zip(stage_layers, meshes)):
            first, last = s == 0, s == len(stage_layers) - 1
            where = (first, last, start, start + count, tied)
            shardings = _stage_parts(sharding.param_shardings(params, mesh), *where)
            stage_attend = sharding.shard_attention(attend, mesh) if tp > 1 else attend
            new_cache = functools.partial(model_lib.init_kv_cache, stage_config(num_layers=count),
                                          num_pages=num_cache_pages, page_size=page_size,
                                          dtype=self.dtype)
            self._stages.append(_Stage(
                index=s, layers=(start, start + count), mesh=mesh,
                params=jax.device_put(_stage_parts(params, *where), shardings),
                # Built in place on the stage's devices (split by KV head under tp).
                cache=jax.jit(new_cache, out_shardings=sharding.kv_cache_sharding(mesh))(),
                inputs_sharding=sharding.replicated(mesh),
                jitted=jax.jit(functools.partial(_stage_step, graphs, stage_attend,
                                                 model_config, first, last), donate_argnums=1)))
            start += count
        self._compile_s = 0.0
        self._num_cache_hits = 0

    @property
    def name(self) -> str:
        return "jax"

    @property
    def needs_token_ids(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    @property
    def tp(self) -> int:
        """Devices of each stage."""
        return self._tp

    @property
    def num_compiles(self) -> int:
        """XLA compilations of every stage (warm-up and steps)."""
        return sum(stage.num_compiles for stage in self._stages)

    def _stage_kv_bytes(self, stage: _Stage) -> int:
        return sum(buffer.addressable_shards[0].data.nbytes
                   for buffer in (*stage.cache.k, *stage.cache.v))

    @property
    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of the KV cache on the device that holds the most (stage 0's first, when
        the layers split evenly)."""
        return max(self._stage_kv_bytes(stage) for stage in self._stages)

    def facts(self) -> dict[str, object]:
        """`JaxEngine.facts`' figures (compiles summed over the stages, a bucket's
        fingerprint that of its stages' programs), and per stage its layers, compiles
        and KV bytes per device."""
        buckets = sorted(self._stages[0].fingerprints)
        fingerprints = {str(b.num_tokens): hashlib.sha256(
            "".join(stage.fingerprints[b] for stage in self._stages).encode()).hexdigest()
            for b in buckets}
        return {
            "num_compiles": self.num_compiles, "compiled_fingerprints": fingerprints,
            "tp": self.tp, "pp": self.num_stages,
            "kv_cache_bytes_per_device": self.kv_cache_bytes_per_device,
            "attention": self.attention, "compile_s": round(self._compile_s, 3),
            "compile_cache_hits": self._num_cache_hits,
            "compile_cache_hit": self.num_compiles > 0
            and self._num_cache_hits == self.num_compiles,
            "executables_loaded": 0, "compile_cache_dir": compile_cache.current_dir() or "none",
            "pp_stages": {f"stage{stage.index}": {
                "layers": stage.layers[1] - stage.layers[0], "num_compiles": stage.num_compiles,
                "devices": [d.id for d in stage.mesh.devices.flat],
                "kv_cache_bytes_per_device": self._stage_kv_bytes(stage)}
                for stage in self._stages}}

    def _prepare(self, buckets: list[Bucket]) -> None:
        """Compiles each stage's program for each bucket not yet compiled, runs it once."""
        todo = [bucket for bucket in buckets if bucket not in self._stages[0].compiled]
        if not todo:
            return
        d_model = self.model_config.d_model

        def compile_bucket(bucket: Bucket, dummy: StepInputs) -> None:
            for stage in self._stages:
                spec = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
                    shape, dtype, sharding=stage.inputs_sharding)
                shapes = jax.tree.map(lambda a: spec(a.shape, a.dtype), dummy)
                x = None if stage.index == 0 else spec((bucket.num_tokens, d_model), self.dtype)
                compile_start = time.perf_counter()
                compiled, count, hits = compile_counted(
                    stage.jitted.lower(stage.params, stage.cache, x, shapes))
                self._compile_s += time.perf_counter() - compile_start
                stage.num_compiles += count
                self._num_cache_hits += hits
                stage.compiled[bucket] = compiled
                stage.fingerprints[bucket] = hlo_fingerprint(compiled)

        warm_up_buckets(self, todo, lambda bucket: dummy_inputs(
            bucket, self.warmup_kv_len, self.pages_per_seq, self.page_size), compile_bucket,
            f" in {self.num_stages} pipeline stages")

    def _check(self, inputs: StepInputs) -> None:
        bucket = inputs.bucket
        self._check_warm(bucket, self._stages[0].compiled)
        if not bucket_arrays_are_consistent(inputs):
            raise ValueError(f"PipelinedJaxEngine.step: StepInputs arrays do not match "
                             f"bucket {bucket}")
        if inputs.page_indices.shape[1] != self.pages_per_seq:
            raise ValueError(f"PipelinedJaxEngine.step: page_indices has "
                             f"{inputs.page_indices.shape[1]} columns, the engine was built "
                             f"with pages_per_seq={self.pages_per_seq}")

    def step(self, inputs: StepInputs) -> StepOutput:
        """Runs one step through every stage; `step_s` is its wall time."""
        return self.step_async(inputs).output()

    def step_async(self, inputs: StepInputs,
                   token_source: Optional[np.ndarray] = None) -> PendingStep:
        """Enqueues every stage of one step and returns at once (see the module docstring).

        Raises:
          ValueError: as `JaxEngine.step`, or a `token_source` (tokens are not fed on the
            device between pipelined steps: a request's next step waits for its token).
        """
        if token_source is not None:
            raise ValueError("PipelinedJaxEngine.step_async: feeds no tokens on the device "
                             "(feeds_tokens is False)")
        self._check(inputs)
        return _DispatchedStep(self, inputs, None)

    def step_stages(self, packed: PackedStep) -> tuple[StepOutput, list[float]]:
        """Runs one step, waiting for each stage in turn: each stage's wall seconds (its
        activations' copy to the next stage's devices included)."""
        inputs = packed.inputs
        self._check(inputs)
        stage_s: list[float] = []
        tokens = self._run_stages(inputs, stage_s)
        return StepOutput(sampled_tokens=np.asarray(tokens), step_s=sum(stage_s)), stage_s

    def _dispatch(self, inputs: StepInputs, token_source: Optional[np.ndarray]
                  ) -> model_lib.StepResult:
        """Enqueues every stage's program (`_DispatchedStep` calls this); returns the
        sampled tokens [S] on the last stage's devices (as a StepResult without logits)."""
        del token_source  # always None here (`step_async` checks)
        # The shape JaxEngine's `_dispatch` returns; only the tokens are read back.
        return model_lib.StepResult(self._run_stages(inputs, None), None)

    def _run_stages(self, inputs: StepInputs, stage_s: Optional[list[float]]) -> jax.Array:
        """Runs the stages in order; with `stage_s`, waits for each and appends its time."""
        bucket = inputs.bucket
        x: Any = None
        for stage, after in zip(self._stages, [*self._stages[1:], None]):
            start = time.perf_counter()
            before = backend_compiles()
            stage.cache, out = stage.compiled[bucket](
                stage.params, stage.cache, x, jax.device_put(inputs, stage.inputs_sharding))
            stage.num_compiles += backend_compiles() - before
            if after is not None:  # the activations cross to the next stage's devices
                out = x = jax.device_put(out, after.inputs_sharding)
            else:
                out = out.tokens  # [S]
            if stage_s is not None:
                out.block_until_ready()
                stage_s.append(time.perf_counter() - start)
        return out

    def host_kv_store(self) -> Optional[object]:
        raise EngineConfigError("jax engine: a host KV tier with pipeline stages (pp > 1) is "
                                "not built; run one stage")

    def read_kv_pages(self, pages: np.ndarray) -> object:  # [n]
        raise EngineConfigError("jax engine: KV transfers with pipeline stages (pp > 1) are "
                                "not built; run one stage")

    def write_kv_pages(self, pages: np.ndarray, kv: object) -> None:  # [n]
        raise EngineConfigError("jax engine: KV transfers with pipeline stages (pp > 1) are "
                                "not built; run one stage")
