"""The real engine: the Flax decoder's paged step, compiled once per bucket.

`JaxEngine` owns the parameters and the paged KV cache on device. `warmup()`
compiles every bucket ahead of time (`jit(...).lower(...).compile()`, the cache
donated so each step updates it in place) and times a few runs of each; `step()`
only ever calls those compiled executables, so a run compiles exactly its
buckets. Compilations are counted from XLA's own compile events (a
`jax.monitoring` listener), not from Python calls, so an accidental recompile
would show in `num_compiles`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import re
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from orca_jax.core.step.engine_api import (
    NULL_PAGE,
    Bucket,
    Engine,
    EngineConfigError,
    PendingStep,
    StepInputs,
    StepOutput,
    bucket_arrays_are_consistent,
)
from orca_jax.core.step.packing import build_step_inputs
from orca_jax.model import compile_cache, distributed, executable_cache, host_kv, sharding
from orca_jax.model import llama as model_lib
from orca_jax.model.bucketed_attention import kv_chunk_pages
from orca_jax.specs.model_config import ModelConfig

_log = logging.getLogger(__name__)
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_backend_compiles = 0  # process-wide count of XLA compilations seen by the listener
_cache_hits = 0  # of which loaded from the persistent compilation cache
_listening = False


def _on_duration_event(event: str, duration_secs: float, **kwargs: object) -> None:
    global _backend_compiles
    if event == _BACKEND_COMPILE_EVENT:
        _backend_compiles += 1


def _on_event(event: str, **kwargs: object) -> None:
    global _cache_hits
    # A hit still reports a backend compile event (jax times the whole compile-or-load).
    if event == _CACHE_HIT_EVENT:
        _cache_hits += 1


def backend_compiles() -> int:
    """XLA compilations in this process since the first call (installs the listeners once);
    a program loaded from the persistent compilation cache counts as one too."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    return _backend_compiles


def cache_hits() -> int:
    """Of `backend_compiles()`, those loaded from the persistent compilation cache."""
    backend_compiles()  # installs the listeners
    return _cache_hits


def hlo_fingerprint(compiled: jax.stages.Compiled) -> str:
    """sha256 of the optimized HLO in XLA's canonical print, without metadata.

    `compiled.as_text()` carries source locations down to the caller's frame, so
    the same step compiled from two call sites would hash differently.
    """
    try:
        # jaxlib's HLO printer is not re-exported under a public jax name.
        from jaxlib import _hlo

        options = _hlo.HloPrintOptions.canonical()  # no metadata, canonical names
        options.print_large_constants = True  # constants are part of the program
        text = "\n".join(module.to_string(options)
                         for module in compiled.runtime_executable().hlo_modules())
    except (ImportError, AttributeError):
        # Another jaxlib: the public text, with the source-location metadata cut out.
        text = re.sub(r",?\s*metadata=\{[^}]*\}", "", compiled.as_text())
    return hashlib.sha256(text.encode()).hexdigest()


class JaxEngine(Engine):
    """An `Engine` running the LLaMA-style model's paged ragged step.

    Args:
      model_config: the model's shapes.
      params: the model's parameter state (`nnx.split(model)[1]`, `weights.init_params`,
        `weights.restore_params` or `weights.load_llama_folder`); cast to `dtype`.
      num_cache_pages: pages in the KV cache, the null page 0 included (a pool of
        N usable pages, `SchedulerConfig.kv.num_kv_pages`, needs N + 1).
      page_size: tokens per page.
      pages_per_seq: page-table width P of every bucket.
      dtype: parameter, activation and KV cache dtype.
      attention: `reference` | `bucketed` | `pallas` | `pallas_interpret` (see
        `model.attention_op`; `bucketed` is the vectorized CPU op).
      warmup_kv_len: context length of the warm-up's dummy sequences; None means
        the full page-table width, the bucket's worst case.
      mesh: a `tp` mesh (`sharding.make_mesh`) to split the weights, the KV cache
        and attention over (tensor parallelism); None runs on the default device.
        After `distributed.initialize` the mesh may span processes: every process
        builds the same engine and runs the same steps, and each step's time is
        process 0's (`distributed.agree_on_step`), so the clocks agree.
      feed_tokens: compile the step with a device-side token buffer: each step
        keeps its sampled tokens on the device and `step_async(inputs, token_source)`
        feeds them to the next step's decodes, so the host never waits for them
        (overlap scheduling). Off, the compiled step is the plain one.
      host_kv_memory: where a run's host KV tier keeps pages (`host_kv_store`):
        `auto` (pinned host memory on an accelerator that offers it, else numpy),
        `pinned_host` or `numpy`.
      verify_rows: compile the step to also return the token after every row, sampled
        as its sequence samples (`StepOutput.row_tokens`): a speculative run's target
        verifies each request's draft tokens with it (`orca_jax.model.speculative`).
        Still one program per bucket.
    """

    def __init__(self, model_config: ModelConfig, params: nnx.State, *, num_cache_pages: int,
                 page_size: int, pages_per_seq: int, dtype: jnp.dtype = jnp.float32,
                 attention: str = "reference",
                 warmup_kv_len: Optional[int] = None,
                 mesh: Optional[jax.sharding.Mesh] = None, feed_tokens: bool = False,
                 host_kv_memory: str = "auto", device: Optional[jax.Device] = None,
                 verify_rows: bool = False) -> None:
        if num_cache_pages < 2 or page_size < 1 or pages_per_seq < 1:
            raise ValueError(f"JaxEngine: needs num_cache_pages >= 2 (null page + one), "
                             f"page_size >= 1, pages_per_seq >= 1; got {num_cache_pages}, "
                             f"{page_size}, {pages_per_seq}")
        max_len = pages_per_seq * page_size
        if warmup_kv_len is not None and not 1 <= warmup_kv_len <= max_len:
            raise ValueError(f"JaxEngine: warmup_kv_len={warmup_kv_len} must be in [1, {max_len}]")
        attend = model_lib.attention_op(attention)  # fails early on an unknown op name
        if host_kv_memory not in host_kv.HOST_KV_MEMORIES:
            raise ValueError(f"JaxEngine: host_kv_memory={host_kv_memory!r} is not one of "
                             f"{host_kv.HOST_KV_MEMORIES}")
        if verify_rows and feed_tokens:
            raise EngineConfigError("JaxEngine: verify_rows (speculative decoding) with "
                                    "feed_tokens (overlap) is not built; run one of them")
        if mesh is not None:
            if tuple(mesh.axis_names) != (sharding.TP_AXIS,):
                raise EngineConfigError(f"JaxEngine: mesh axes {mesh.axis_names} must be "
                                        f"({sharding.TP_AXIS!r},); build it with "
                                        "sharding.make_mesh")
            sharding.make_mesh(mesh.size, model_config, list(mesh.devices.flat))  # divisibility
            attend = sharding.shard_attention(attend, mesh)
        self.model_config = model_config
        self.num_cache_pages, self.page_size = num_cache_pages, page_size
        self.pages_per_seq = pages_per_seq
        self.dtype = jnp.dtype(dtype)
        self.attention = attention
        self.mesh = mesh
        # Without a mesh: the one device of the weights and cache (a cluster's replica on
        # a device of its own), None for the default one.
        self.device = device if mesh is None else None
        self.warmup_kv_len = warmup_kv_len if warmup_kv_len is not None else max_len
        graphdef, abstract = model_lib.abstract_model(model_config, self.dtype)
        self._check_params(abstract, params)
        params = jax.tree.map(
            lambda a: a.astype(self.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
        new_cache = functools.partial(model_lib.init_kv_cache, model_config,
                                      num_pages=num_cache_pages, page_size=page_size,
                                      dtype=self.dtype)
        if mesh is None and device is not None:
            self._params = jax.device_put(params, device)
            with jax.default_device(device):  # built there, then committed to it
                self._cache = jax.device_put(new_cache(), device)
            self._inputs_sharding = None
        elif mesh is None:
            self._params = jax.device_put(params)
            self._cache = new_cache()
            self._inputs_sharding = None
        else:
            self._params = jax.device_put(params, sharding.param_shardings(params, mesh))
            # Built in place, split: the whole cache never sits on one device.
            self._cache = jax.jit(new_cache, out_shardings=sharding.kv_cache_sharding(mesh))()
            self._inputs_sharding = sharding.replicated(mesh)
        self._feed = feed_tokens
        self._fed_size = 0  # rows of the device token buffer: the widest bucket's S
        self._fed: Optional[jax.Array] = None  # [fed_size] the last step's sampled tokens
        self._verify = verify_rows
        step_fn = (_step_feeding_tokens if feed_tokens
                   else functools.partial(_plain_step, every_row=verify_rows))
        self._jitted = jax.jit(functools.partial(step_fn, graphdef, attend), donate_argnums=1)
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self._fingerprints: dict[Bucket, str] = {}
        self._num_compiles = 0
        self._num_cache_hits = 0
        self._num_executables_loaded = 0  # steps loaded from `executable_cache`
        self._compile_s = 0.0
        self._multiprocess = distributed.is_multiprocess()
        self._host_kv_memory = host_kv_memory
        self._host_kv: Optional[host_kv.HostKVStore] = None  # made for a run's host tier

    @staticmethod
    def _check_params(abstract: nnx.State, params: nnx.State) -> None:
        want = dict(jax.tree_util.tree_leaves_with_path(abstract))
        got = dict(jax.tree_util.tree_leaves_with_path(params))
        for path, leaf in want.items():
            name = jax.tree_util.keystr(path)
            if path not in got:
                raise ValueError(f"JaxEngine: params lack {name} (expected shape {leaf.shape})")
            if got[path].shape != leaf.shape:
                raise ValueError(f"JaxEngine: params {name} has shape {got[path].shape}, "
                                 f"expected {leaf.shape}")

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
    def tp(self) -> int:
        """Tensor-parallel degree (devices the step is split over)."""
        return 1 if self.mesh is None else self.mesh.size

    @property
    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of the paged KV cache on each device (1/tp of it under a mesh)."""
        return sum(buffer.addressable_shards[0].data.nbytes
                   for buffer in (*self._cache.k, *self._cache.v))

    @property
    def num_compiles(self) -> int:
        """XLA compilations this engine triggered (warm-up and steps)."""
        return self._num_compiles

    def facts(self) -> dict[str, object]:
        """Compiles, their HLO fingerprints by bucket tokens, tp and KV bytes per device,
        the attention op, compile seconds and persistent-cache hits."""
        facts: dict[str, object] = {
            "num_compiles": self.num_compiles,
            "compiled_fingerprints": {str(b.num_tokens): h for b, h in
                                      sorted(self._fingerprints.items())},
            "tp": self.tp, "kv_cache_bytes_per_device": self.kv_cache_bytes_per_device,
            "attention": self.attention if isinstance(self.attention, str) else "custom",
            "compile_s": round(self._compile_s, 3),
            # Compiled programs loaded from the persistent cache (`compile_cache`) instead.
            "compile_cache_hits": self._num_cache_hits,
            "compile_cache_hit": self._num_compiles > 0
            and self._num_cache_hits == self._num_compiles,
            # Of those, steps loaded whole from `executable_cache` (not traced or lowered).
            "executables_loaded": self._num_executables_loaded,
            "compile_cache_dir": compile_cache.current_dir() or "none"}
        if self._host_kv is not None:  # a run with a host KV tier: what it copied
            facts.update(self._host_kv.facts())
        if self.attention == "bucketed":
            # One program per bucket; it loops over this many KV tokens at a time.
            facts["attention_kv_chunk_tokens"] = kv_chunk_pages(self.page_size) * self.page_size
        return facts

    def fingerprints(self) -> dict[Bucket, str]:
        """sha256 of each compiled step's optimized HLO text, by bucket."""
        return dict(self._fingerprints)

    def _prepare(self, buckets: list[Bucket]) -> None:
        """Compiles each bucket not yet compiled and runs it once on dummy inputs."""
        todo = [bucket for bucket in buckets if bucket not in self._compiled]
        if self._host_kv is not None:  # a run's host KV tier: its copies compile here too
            self._host_kv.warmup()
        if not todo:
            return
        if self._feed:
            widest = max(bucket.num_seqs for bucket in buckets)
            if self._fed is not None and widest > self._fed_size:
                raise ValueError(f"JaxEngine.warmup: feed_tokens fixed the token buffer at "
                                 f"{self._fed_size} sequences at the first warm-up; bucket "
                                 f"S={widest} needs more (warm every bucket up at once)")
            if self._fed is None:
                self._fed_size = widest
                self._fed = self._to_device(np.zeros(widest, np.int32))

        def compile_bucket(bucket: Bucket, dummy: StepInputs) -> None:
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=self._inputs_sharding), dummy)
            extra = ()
            if self._feed:
                extra = tuple(jax.ShapeDtypeStruct((size,), jnp.int32,
                                                   sharding=self._inputs_sharding)
                              for size in (self._fed_size, bucket.num_tokens))
            compile_start = time.perf_counter()
            compiled = self._load_or_compile((self._params, self._cache, shapes, *extra))
            self._compile_s += time.perf_counter() - compile_start
            self._compiled[bucket] = compiled
            self._fingerprints[bucket] = hlo_fingerprint(compiled)

        warm_up_buckets(self, todo, self._dummy_inputs, compile_bucket)

    def _load_or_compile(self, args: tuple[Any, ...]) -> jax.stages.Compiled:
        """The step compiled for `args`' shapes: from the executable cache when it holds
        it (no trace, no lowering), else compiled and stored there. A loaded program
        counts the compiles (and cache hits) it took when it was stored."""
        key = None
        if (compile_cache.current_dir() is not None and executable_cache.usable()
                and isinstance(self.attention, str) and not self._multiprocess):
            key = executable_cache.program_key(self._static_choices(), args)
            loaded = executable_cache.load(key)
            if loaded is not None:
                compiled, count = loaded
                self._num_compiles += count
                self._num_cache_hits += count
                self._num_executables_loaded += 1
                return compiled
        # What the executable cache stores must be compiled here, not loaded from JAX's.
        with compile_cache.bypassed() if key is not None else contextlib.nullcontext():
            compiled, count, hits = compile_counted(self._jitted.lower(*args))
        self._num_compiles += count
        self._num_cache_hits += hits
        if key is not None:
            executable_cache.store(key, compiled, count)
        return compiled

    def _static_choices(self) -> dict[str, Any]:
        """What the step's trace closes over besides its arguments (the cache key's part)."""
        mesh = None if self.mesh is None else (tuple(self.mesh.axis_names),
                                               [d.id for d in self.mesh.devices.flat])
        step = "feeding" if self._feed else "verifying" if self._verify else "plain"
        choices = {"step": step, "attention": self.attention,
                   "model": dataclasses.asdict(self.model_config), "dtype": str(self.dtype),
                   "mesh": mesh}
        if self.device is not None:  # an executable is compiled for its device
            choices["device"] = self.device.id
        return choices

    @property
    def feeds_tokens(self) -> bool:
        return self._feed

    def step(self, inputs: StepInputs) -> StepOutput:
        """Runs one compiled step; `step_s` is its measured wall time.

        Raises:
          ValueError: the bucket was not warmed up (it would compile), or the
            arrays do not match the bucket or this engine's page-table width.
        """
        return self.step_async(inputs).output()

    def step_async(self, inputs: StepInputs,
                   token_source: Optional[np.ndarray] = None) -> PendingStep:
        """Dispatches one compiled step and returns at once (JAX runs it asynchronously).

        Args:
          inputs: the step's descriptor.
          token_source: [T] int32 or None (needs `feed_tokens`): row t >= 0 takes token
            t from sequence `token_source[t]`'s sampled token of the previous step
            dispatched here, -1 takes `inputs.token_ids[t]`.

        Raises:
          ValueError: as `step`, or a `token_source` without `feed_tokens`, or one
            that is not [T].
        """
        if token_source is not None:
            if not self._feed:
                raise ValueError("JaxEngine.step_async: token_source needs feed_tokens=True")
            if token_source.shape != (inputs.bucket.num_tokens,):
                raise ValueError(f"JaxEngine.step_async: token_source has shape "
                                 f"{token_source.shape}, bucket {inputs.bucket} needs "
                                 f"({inputs.bucket.num_tokens},)")
        bucket = inputs.bucket
        self._check_warm(bucket, self._compiled)
        if not bucket_arrays_are_consistent(inputs):
            raise ValueError(f"JaxEngine.step: StepInputs arrays do not match bucket {bucket}")
        if inputs.page_indices.shape[1] != self.pages_per_seq:
            raise ValueError(f"JaxEngine.step: page_indices has {inputs.page_indices.shape[1]} "
                             f"columns, the engine was built with pages_per_seq="
                             f"{self.pages_per_seq}")
        return _DispatchedStep(self, inputs, token_source)

    def read_kv_pages(self, pages: np.ndarray) -> tuple[int, model_lib.KVCache]:  # [n]
        """These pages' K and V (a disaggregated transfer's payload), padded to the
        page-table width with the null page so that one compiled gather serves all."""
        return len(pages), _gather_pages(self._cache, self._padded(pages))

    def write_kv_pages(self, pages: np.ndarray, kv: object) -> None:  # [n]
        """Writes another engine's `read_kv_pages` into these pages, in order."""
        count, data = kv  # type: ignore[misc]
        if count != len(pages):
            raise ValueError(f"JaxEngine.write_kv_pages: {count} pages of KV for "
                             f"{len(pages)} pages")
        # From an engine on other devices: onto this cache's (a no-op on the same ones).
        data = jax.tree.map(lambda d, c: jax.device_put(d, c.sharding), data, self._cache)
        self._cache = _scatter_pages(self._cache, self._padded(pages), data)

    def wait_kv(self) -> None:
        """Blocks until the cache's pending writes (steps, `write_kv_pages`) are done."""
        jax.block_until_ready(self._cache)

    def host_kv_store(self) -> host_kv.HostKVStore:
        """A host KV tier's pages in host memory (`host_kv.HostKVStore`; one per engine:
        a run's scheduler takes it, and `facts` report its copies).

        Raises:
          EngineConfigError: on a mesh spanning processes (not built).
        """
        if self._multiprocess:
            raise EngineConfigError("JaxEngine: a host KV tier on a mesh spanning processes "
                                    "is not built; run it on one process")
        device = (self.mesh.devices.flat[0] if self.mesh is not None
                  else self.device or jax.devices()[0])
        self._host_kv = host_kv.HostKVStore(
            self, host_kv.host_memory_kind(device, self._host_kv_memory))
        return self._host_kv

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one cache page, every layer's K and V (all shards)."""
        return sum(buffer.nbytes // self.num_cache_pages
                   for buffer in (*self._cache.k, *self._cache.v))

    def gather_kv_pages(self, pages: np.ndarray) -> model_lib.KVCache:  # [W]
        """A copy of these pages' K and V on the device (a block of its own, which
        later steps' writes to the cache do not touch), after every step dispatched."""
        return _gather_pages(self._cache, pages)

    def scatter_kv_pages(self, pages: np.ndarray,  # [W] target pages (null: padding)
                         data: model_lib.KVCache,  # layers x [W', page_size, heads, dim]
                         rows: np.ndarray) -> None:  # [W] row of `data` for each page
        """Writes row `rows[i]` of `data` into cache page `pages[i]`, before any step
        dispatched later."""
        self._cache = _scatter_rows(self._cache, pages, data, rows)

    def _padded(self, pages: np.ndarray) -> np.ndarray:  # [n] -> [P]
        if len(pages) > self.pages_per_seq:
            raise ValueError(f"JaxEngine: {len(pages)} pages are more than a sequence holds "
                             f"({self.pages_per_seq})")
        padded = np.full(self.pages_per_seq, NULL_PAGE, np.int32)
        padded[:len(pages)] = pages
        return padded

    def _dispatch(self, inputs: StepInputs, token_source: Optional[np.ndarray]
                  ) -> model_lib.StepResult:
        """Calls the bucket's compiled step; returns its result (tokens [S], and [T] row
        tokens under `verify_rows`), on the device."""
        before = backend_compiles()
        args = (self._params, self._cache, self._to_device(inputs))
        if self._feed:
            if token_source is None:
                token_source = np.full(inputs.bucket.num_tokens, -1, np.int32)
            self._cache, result, self._fed = self._compiled[inputs.bucket](
                *args, self._fed, self._to_device(token_source.astype(np.int32)))
        else:
            self._cache, result = self._compiled[inputs.bucket](*args)
        self._num_compiles += backend_compiles() - before
        return result

    def _to_device(self, inputs: Any) -> Any:
        """The descriptor on the mesh's devices (replicated), or as it is (host arrays) for
        one device."""
        if self.mesh is None and not self._multiprocess:
            # The compiled step takes host arrays itself, in one C++ call: ~30 us for a
            # descriptor's dozen arrays, where `jax.device_put` of the pytree takes ~250 us
            # (measured on a 2-core CPU), a tenth of a tiny model's decode step. On a CPU
            # both may alias the host arrays while the step runs: a descriptor's arrays
            # must not be written after dispatch (`build_step_inputs` makes new ones).
            return inputs
        if not self._multiprocess:
            return jax.device_put(inputs, self._inputs_sharding)
        # jax.device_put onto a mesh spanning processes compiles a transfer program per
        # shape; building the global array from this process's copies compiles nothing.
        return jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, self._inputs_sharding, lambda index: a[index]), inputs)

    def _dummy_inputs(self, bucket: Bucket) -> StepInputs:
        return dummy_inputs(bucket, self.warmup_kv_len, self.pages_per_seq, self.page_size)


def compile_counted(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, int, int]:
    """`lowered` compiled, with the XLA compilations it took and, of those, the programs
    loaded from the persistent compilation cache."""
    before, hits_before = backend_compiles(), cache_hits()
    compiled = lowered.compile()
    return compiled, backend_compiles() - before, cache_hits() - hits_before


def warm_up_buckets(engine: Engine, todo: list[Bucket],
                    dummy: Callable[[Bucket], StepInputs],
                    compile_bucket: Callable[[Bucket, StepInputs], None],
                    where: str = "") -> None:
    """The jax engines' warm-up: each bucket of `todo` compiled (`compile_bucket`, which
    keeps the engine's programs and counts) and run once on its dummy inputs, the first
    run paying one-off allocations; logged before and after (`where`: words after the
    first line's bucket list)."""
    # Compiling takes seconds per bucket: say so, or a run looks stuck before its first step.
    _log.info("jax engine: compiling %d step buckets (%s tokens)%s", len(todo),
              ",".join(str(b.num_tokens) for b in todo), where)
    start = time.perf_counter()
    for bucket in todo:
        inputs = dummy(bucket)
        compile_bucket(bucket, inputs)
        _DispatchedStep(engine, inputs, None).wait()
    _log.info("jax engine: %d buckets compiled in %.1f s", len(todo),
              time.perf_counter() - start)


def dummy_inputs(bucket: Bucket, kv_len: int, pages_per_seq: int, page_size: int) -> StepInputs:
    """A full bucket for a warm-up: up to S sequences sharing T tokens, each at the end of
    a `kv_len`-token context, all reading and writing the null page."""
    t, s = bucket.num_tokens, bucket.num_seqs
    q_lens = np.minimum(t // s + (np.arange(s) < t % s), kv_len)  # [S]
    q_lens = q_lens[q_lens > 0]  # fewer tokens than sequences: the rest are padding
    return build_step_inputs(
        bucket, num_tokens=q_lens, num_computed=kv_len - q_lens,
        page_rows=np.full((q_lens.size, pages_per_seq), NULL_PAGE, np.int32),
        page_size=page_size)


def _plain_step(graphdef: nnx.GraphDef, attend: Any, params: nnx.State,
                cache: model_lib.KVCache, inputs: StepInputs, *, every_row: bool = False
                ) -> tuple[model_lib.KVCache, model_lib.StepResult]:
    return model_lib.step(graphdef, params, cache, inputs, attention=attend,
                          every_row=every_row)


def _step_feeding_tokens(graphdef: nnx.GraphDef, attend: Any, params: nnx.State,
                         cache: model_lib.KVCache, inputs: StepInputs,
                         fed: jax.Array,  # [F] the previous step's sampled tokens
                         token_source: jax.Array,  # [T] row of `fed`, or -1: the host's id
                         ) -> tuple[model_lib.KVCache, model_lib.StepResult, jax.Array]:
    """The step, with decode inputs taken from the previous step's tokens on the device;
    returns this step's tokens in a new [F] buffer for the next one."""
    from_device = fed[jnp.clip(token_source, 0, fed.shape[0] - 1)]  # [T]
    inputs = dataclasses.replace(
        inputs, token_ids=jnp.where(token_source >= 0, from_device, inputs.token_ids))
    cache, result = model_lib.step(graphdef, params, cache, inputs, attention=attend)
    rows = min(fed.shape[0], result.tokens.shape[0])
    return cache, result, jnp.zeros_like(fed).at[:rows].set(result.tokens[:rows])


class _DispatchedStep(PendingStep):
    """A JaxEngine step in flight: its tokens are read back (and its time measured) on
    the first `output()` or `step_s`, so the host can work meanwhile."""

    def __init__(self, engine: JaxEngine, inputs: StepInputs,
                 token_source: Optional[np.ndarray]) -> None:
        self._engine, self._inputs = engine, inputs
        self._start = time.perf_counter()
        result = engine._dispatch(inputs, token_source)
        self._device_tokens = result.tokens  # [S], on the device
        self._device_rows = result.row_tokens  # [T] under verify_rows, else None
        self.dispatched_at = time.perf_counter()  # the host is free again from here
        self.ready_at: Optional[float] = None  # the tokens were ready on the device
        self.landed_at: Optional[float] = None  # ... and copied to the host
        self._done: Optional[tuple[np.ndarray, float]] = None
        self._rows: Optional[np.ndarray] = None  # [T] row tokens on the host

    def wait(self) -> tuple[np.ndarray, float]:
        """(sampled tokens [S], seconds from dispatch until they were on the host)."""
        if self._done is None:
            # The tokens are replicated: this process's shard is all of them (under a mesh
            # spanning processes the array is not fully addressable, so no np.asarray).
            shard = self._device_tokens.addressable_shards[0].data
            shard.block_until_ready()
            self.ready_at = time.perf_counter()
            tokens = np.asarray(shard)  # [S]
            if self._device_rows is not None:  # a verification step's rows: one copy more
                self._rows = np.asarray(self._device_rows.addressable_shards[0].data)
            self.landed_at = time.perf_counter()
            elapsed = self.landed_at - self._start
            if self._engine._multiprocess:  # one clock: process 0's; descriptors checked
                elapsed = distributed.agree_on_step(elapsed, self._inputs)
            self._done = (tokens, elapsed)
        return self._done

    @property
    def step_s(self) -> float:
        return self.wait()[1]

    def timings(self) -> dict[str, float]:
        """Seconds (perf_counter) of the step's life, for overlap diagnosis: `dispatch_s`
        (host time inside the dispatch call), `ready_s` (dispatch start to the tokens
        ready on the device, as seen by the host's wait), `readback_s` (their copy to
        the host); the latter two need `wait()` first."""
        out = {"start": self._start, "dispatch_s": self.dispatched_at - self._start}
        if self.ready_at is not None and self.landed_at is not None:
            out.update(ready_s=self.ready_at - self._start,
                       readback_s=self.landed_at - self.ready_at)
        return out

    def output(self) -> StepOutput:
        tokens, elapsed = self.wait()
        return StepOutput(sampled_tokens=tokens, step_s=elapsed, row_tokens=self._rows)


@jax.jit
def _gather_pages(cache: model_lib.KVCache, pages: jax.Array  # [P]
                  ) -> model_lib.KVCache:  # layers x [P, page_size, kv_heads, head_dim]
    return model_lib.KVCache(k=tuple(k[pages] for k in cache.k),
                             v=tuple(v[pages] for v in cache.v))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(cache: model_lib.KVCache, pages: jax.Array,  # [W]
                  kv: model_lib.KVCache, rows: jax.Array  # [W] rows of kv
                  ) -> model_lib.KVCache:
    # Padding entries write row 0 into the null page, which no request reads.
    return model_lib.KVCache(k=tuple(k.at[pages].set(x[rows]) for k, x in zip(cache.k, kv.k)),
                             v=tuple(v.at[pages].set(x[rows]) for v, x in zip(cache.v, kv.v)))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_pages(cache: model_lib.KVCache, pages: jax.Array,  # [P]
                   kv: model_lib.KVCache) -> model_lib.KVCache:
    # Padding rows carry the source's null page into this cache's null page, which no
    # request reads.
    return model_lib.KVCache(k=tuple(k.at[pages].set(x) for k, x in zip(cache.k, kv.k)),
                             v=tuple(v.at[pages].set(x) for v, x in zip(cache.v, kv.v)))
