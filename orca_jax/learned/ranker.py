"""Learning to rank output lengths (Fu et al., NeurIPS'24): a small model, trained with optax.

SJF and SRPT need the *order* of requests by output length, not the lengths
themselves; Fu et al. train a model on prompts to rank them (ListMLE) and
schedule by its score. `Ranker` does that over what a `Request` carries:

  * a hashed bag of prompt tokens (`num_token_buckets` buckets, as fractions of
    the prompt) through a learned embedding, i.e. the prompt's mean token
    embedding: this is where "which kind of task is this" is read from;
  * log prompt length, whether token ids are present, priority, and a one-hot
    of the tenant's (stable, crc32) hash bucket; standardised with the
    training set's mean and spread.

An MLP maps these to a score that grows with the predicted output length. The
loss is ListMLE (the paper's) or RankNet (pairwise logistic) on random lists
of training requests, whose target order is their true output length.

As a length predictor (`predict_output_len`) the score is mapped to tokens by
a monotone calibration fitted on the training set: the score's quantile among
the training scores is read off the training output lengths at the same
quantile. The mapping keeps the score's order (up to ties from rounding) and
gives numbers in output-token units, which SRPT needs for "remaining work".

Inference is numpy on the restored parameters, so a policy's hot path never
touches jax; jax, optax and orbax are needed to train, save and restore.
`orca_jax.learned.length_predictor.register_ltr_predictor(dir)` registers a
saved ranker in the predictor registry under `ltr:<absolute dir>`; the
predictor registry imports this module (lazily), never the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import zlib
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from numpy.typing import NDArray

from orca_jax.core.requests.request import Request
from orca_jax.learned.ranker_config import LOSSES, NUM_DENSE, RankerConfig  # noqa: F401  (its API)

_CONFIG_FILE = "ranker.json"
_PARAMS_DIR = "params"
_HASH_MULTIPLIER = np.uint64(2654435761)  # Knuth's: spreads contiguous id ranges over buckets


def request_features(requests: Sequence[Request], config: RankerConfig
                     ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Features of `requests`: `([n, num_token_buckets] bag, [n, num_dense] dense)`.

    The bag row of a request without token ids is zero (its flag says so).
    """
    n, buckets = len(requests), config.num_token_buckets
    bag = np.zeros((n, buckets), dtype=np.float32)  # [n, B]
    dense = np.zeros((n, config.num_dense), dtype=np.float32)  # [n, F]
    rows, ids = [], []
    for i, request in enumerate(requests):
        dense[i, 0] = math.log1p(request.prompt_len)
        dense[i, 2] = request.priority
        tenant = zlib.crc32(request.tenant.encode()) % config.num_tenant_buckets
        dense[i, NUM_DENSE + tenant] = 1.0
        if request.prompt_tokens is not None:
            dense[i, 1] = 1.0
            rows.append(np.full(request.prompt_len, i, dtype=np.int64))
            ids.append(request.prompt_tokens)
    if rows:
        tokens = np.concatenate(ids).astype(np.uint64)  # [total_tokens]
        # Multiplicative hashing keeps the *high* bits: the low ones only permute id % B.
        hashed = ((tokens * _HASH_MULTIPLIER) % np.uint64(2**32)) * np.uint64(buckets) >> 32
        row = np.concatenate(rows)  # [total_tokens]
        np.add.at(bag, (row, hashed.astype(np.int64)), 1.0)
        lengths = np.array([r.prompt_len for r in requests], dtype=np.float32)  # [n]
        bag /= lengths[:, None]
    return bag, dense


def _scores_reference(params: dict[str, jax.Array], bag: jax.Array,  # [n, B]
                      dense: jax.Array) -> jax.Array:  # [n, F] standardised -> [n]
    """The model, in jnp (training). `Ranker.scores` is the same arithmetic in numpy."""
    x = jnp.concatenate([bag @ params["embed"], dense], axis=-1)
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def listmle_loss(scores: jax.Array) -> jax.Array:  # [S, L], each list longest first -> []
    """ListMLE: minus the log Plackett-Luce likelihood of the true order (longest first)."""
    # log sum_{j >= i} exp(s_j) as a masked [L, L] logsumexp: stable, and lists are short.
    size = scores.shape[1]
    tail = jnp.arange(size)[None, :] >= jnp.arange(size)[:, None]  # [L, L]: j >= i
    tail_logsumexp = jax.nn.logsumexp(scores[:, None, :], axis=-1, where=tail[None])  # [S, L]
    return jnp.mean(jnp.sum(tail_logsumexp - scores, axis=1))


def ranknet_loss(scores: jax.Array,  # [S, L], each list longest first
                 lengths: jax.Array) -> jax.Array:  # [S, L] -> []
    """RankNet: logistic loss on every pair of a list with different lengths."""
    longer = lengths[:, :, None] > lengths[:, None, :]  # [S, L, L]
    margins = scores[:, :, None] - scores[:, None, :]
    return jnp.sum(jnp.where(longer, jax.nn.softplus(-margins), 0.0)) / jnp.maximum(
        jnp.sum(longer), 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Ranker:
    """A trained ranker: config and numpy parameters. Also a `LengthPredictor`.

    Attributes:
      config: the model's shape and how it was trained.
      params: `embed [B, D]`, `w1 [D + F, H]`, `b1 [H]`, `w2 [H]`, `b2 []`,
        `dense_mean [F]`, `dense_std [F]` (feature standardisation), and
        `calib_scores [K]`, `calib_lengths [K]` (the score-to-length quantiles).
    """

    config: RankerConfig
    params: dict[str, NDArray[np.float32]]

    def scores(self, requests: Sequence[Request]) -> NDArray[np.float32]:
        """`[n]` ranking scores: higher means a longer predicted output."""
        p = self.params
        bag, dense = request_features(requests, self.config)
        x = np.concatenate([bag @ p["embed"], (dense - p["dense_mean"]) / p["dense_std"]], -1)
        return np.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]

    def predict_output_len(self, requests: Sequence[Request]) -> NDArray[np.int64]:
        """`[n]` output lengths (>= 1) read off the calibration at each request's score."""
        lengths = np.interp(self.scores(requests), self.params["calib_scores"],
                            self.params["calib_lengths"])
        return np.maximum(np.rint(lengths), 1).astype(np.int64)

    def save(self, directory: str) -> None:
        """Writes the ranker to `directory` (created; must not hold a ranker yet)."""
        directory = os.path.abspath(directory)
        if os.path.exists(os.path.join(directory, _PARAMS_DIR)):
            raise FileExistsError(f"ranker directory {directory} already holds a saved ranker")
        os.makedirs(directory, exist_ok=True)
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.join(directory, _PARAMS_DIR), self.params)
            checkpointer.wait_until_finished()
        with open(os.path.join(directory, _CONFIG_FILE), "w") as f:
            json.dump(dataclasses.asdict(self.config), f, indent=1, sort_keys=True)

    @classmethod
    def restore(cls, directory: str) -> "Ranker":
        """Reads a ranker written by `save`.

        Raises:
          FileNotFoundError: `directory` or one of its two parts is missing (named).
        """
        directory = os.path.abspath(directory)
        config_path = os.path.join(directory, _CONFIG_FILE)
        for path in (config_path, os.path.join(directory, _PARAMS_DIR)):
            if not os.path.exists(path):
                raise FileNotFoundError(f"no saved ranker at {directory}: {path} is missing "
                                        "(train one with python -m experiments.train_ranker)")
        with open(config_path) as f:
            config = RankerConfig(**json.load(f))
        target = {name: jax.ShapeDtypeStruct(shape, jnp.float32)
                  for name, shape in _param_shapes(config).items()}
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(os.path.join(directory, _PARAMS_DIR), target)
        return cls(config, {k: np.asarray(v, dtype=np.float32) for k, v in restored.items()})


def _param_shapes(config: RankerConfig) -> dict[str, tuple[int, ...]]:
    d, f, h = config.embed_dim, config.num_dense, config.hidden_dim
    return {"embed": (config.num_token_buckets, d), "w1": (d + f, h), "b1": (h,), "w2": (h,),
            "b2": (), "dense_mean": (f,), "dense_std": (f,),
            "calib_scores": (config.num_calibration_points,),
            "calib_lengths": (config.num_calibration_points,)}


def _init_params(config: RankerConfig, key: jax.Array) -> dict[str, jax.Array]:
    shapes = _param_shapes(config)
    k_embed, k_w1, k_w2 = jax.random.split(key, 3)
    glorot = jax.nn.initializers.glorot_normal()
    return {"embed": jax.random.normal(k_embed, shapes["embed"]) * 0.5,
            "w1": glorot(k_w1, shapes["w1"]), "b1": jnp.zeros(shapes["b1"]),
            "w2": jax.random.normal(k_w2, shapes["w2"]) / math.sqrt(config.hidden_dim),
            "b2": jnp.zeros(())}


def _training_lists(rng: np.random.Generator, lengths: NDArray[np.int64],  # [n]
                    config: RankerConfig) -> NDArray[np.int64]:  # [S, L]
    """Random lists of training indices, each sorted longest first (ties at random)."""
    n = len(lengths)
    lists = np.stack([rng.choice(n, size=config.list_size, replace=n < config.list_size)
                      for _ in range(config.lists_per_step)])
    tie_break = rng.random(lists.shape)
    order = np.lexsort((tie_break, -lengths[lists]), axis=-1)
    return np.take_along_axis(lists, order, axis=1)


def _optimizer(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.adamw(learning_rate, weight_decay=weight_decay)


@functools.partial(jax.jit, static_argnames=("loss", "learning_rate", "weight_decay"))
def _train_step(params: dict[str, jax.Array], opt_state: optax.OptState, lists: jax.Array,  # [S, L]
                bag: jax.Array, dense: jax.Array,  # [n, B], [n, F] standardised
                lengths: jax.Array, *, loss: str,  # [n]
                learning_rate: float, weight_decay: float
                ) -> tuple[dict[str, jax.Array], optax.OptState]:
    """One AdamW step on a batch of lists (module level: compiled once per shape)."""

    def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
        scores = _scores_reference(params, bag[lists], dense[lists])  # [S, L]
        if loss == "listmle":
            return listmle_loss(scores)
        return ranknet_loss(scores, lengths[lists])

    grads = jax.grad(loss_fn)(params)
    optimizer = _optimizer(learning_rate, weight_decay)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def train_ranker(requests: Sequence[Request], config: Optional[RankerConfig] = None) -> Ranker:
    """Trains a ranker on `requests` (their true `output_len` is the target order).

    Deterministic on CPU for a given config (its seed) and request list. The
    token bags are dense, `[n, num_token_buckets]` float32: 16 MB per 1,000
    requests at the default 4,096 buckets.

    Raises:
      ValueError: fewer than 2 requests, or all of one output length (no order to learn).
    """
    config = config or RankerConfig()
    lengths = np.array([r.output_len for r in requests], dtype=np.int64)  # [n]
    if len(requests) < 2 or (lengths == lengths[0]).all():
        raise ValueError(f"train_ranker needs >= 2 requests with different output lengths, got "
                         f"{len(requests)} with lengths {sorted(set(lengths.tolist()))[:5]}")
    bag, dense = request_features(requests, config)
    dense_mean = dense.mean(axis=0)  # [F]
    dense_std = np.where(dense.std(axis=0) > 1e-6, dense.std(axis=0), 1.0).astype(np.float32)
    features = (jnp.asarray(bag), jnp.asarray((dense - dense_mean) / dense_std),
                jnp.asarray(lengths, dtype=jnp.float32))
    params = _init_params(config, jax.random.PRNGKey(config.seed))
    opt_state = _optimizer(config.learning_rate, config.weight_decay).init(params)
    rng = np.random.default_rng(config.seed)
    for _ in range(config.num_steps):
        lists = jnp.asarray(_training_lists(rng, lengths, config))
        params, opt_state = _train_step(params, opt_state, lists, *features, loss=config.loss,
                                        learning_rate=config.learning_rate,
                                        weight_decay=config.weight_decay)
    params = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    params.update(dense_mean=dense_mean.astype(np.float32), dense_std=dense_std,
                  calib_scores=np.zeros(config.num_calibration_points, np.float32),
                  calib_lengths=np.zeros(config.num_calibration_points, np.float32))
    quantiles = np.linspace(0.0, 1.0, config.num_calibration_points)  # [K]
    # np.interp needs increasing x; equal score quantiles (a flat region) would tie anyway.
    calib_scores = np.quantile(Ranker(config, params).scores(requests), quantiles)
    calib_scores = calib_scores + np.arange(len(quantiles)) * 1e-6 * (1 + np.abs(calib_scores))
    return Ranker(config, {**params, "calib_scores": calib_scores.astype(np.float32),
                           "calib_lengths": np.quantile(lengths, quantiles).astype(np.float32)})


def kendall_tau(x: NDArray, y: NDArray) -> float:  # x, y: [n]
    """Kendall's tau-b between two orderings (ties handled), exact, in O(n^2) numpy.

    Raises:
      ValueError: the arrays differ in shape or hold fewer than 2 values.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"kendall_tau needs two [n] arrays with n >= 2, got {x.shape}, {y.shape}")
    concordance = ties_x = ties_y = 0.0
    for start in range(0, len(x), 512):  # rows in blocks: memory O(512 n)
        sx = np.sign(x[start:start + 512, None] - x[None, :])  # [b, n]
        sy = np.sign(y[start:start + 512, None] - y[None, :])
        concordance += float(np.sum(sx * sy))
        ties_x += float(np.sum(sx != 0))
        ties_y += float(np.sum(sy != 0))
    if ties_x == 0 or ties_y == 0:
        return 0.0  # one side is constant: no order to agree with
    return concordance / math.sqrt(ties_x * ties_y)


def synthetic_ranking_workload(num_requests: int, *, seed: int = 0, num_tasks: int = 8,
                               vocab_size: int = 32000, task_token_fraction: float = 0.25,
                               min_prompt_len: int = 16, max_prompt_len: int = 256,
                               min_output_len: int = 4, max_output_len: int = 512,
                               noise_sigma: float = 0.25, arrival_rate: Optional[float] = None
                               ) -> list[Request]:
    """Requests whose output length follows their prompt's "task" and length.

    Task k (uniform over `num_tasks`) has a mean output length log-spaced in
    [`min_output_len`, `max_output_len`] and its own range of 256 token ids; a
    prompt draws `task_token_fraction` of its tokens from its task's range and
    the rest from a shared filler range. The output length is the task mean
    times `(prompt_len / 128) ** 0.3` times lognormal noise (`noise_sigma`),
    clipped to [1, max_output_len]. Arrivals: all at t=0, or Poisson at
    `arrival_rate` req/s.
    """
    task_range = 256
    filler = vocab_size - num_tasks * task_range
    if num_requests < 1 or num_tasks < 1 or filler < task_range:
        raise ValueError(f"synthetic_ranking_workload: need num_requests >= 1 and vocab_size >= "
                         f"(num_tasks + 1) * {task_range}, got {num_requests}, {vocab_size}")
    rng = np.random.default_rng(seed)
    task_means = np.geomspace(min_output_len, max_output_len, num_tasks)  # [num_tasks]
    tasks = rng.integers(0, num_tasks, num_requests)
    prompt_lens = rng.integers(min_prompt_len, max_prompt_len, num_requests, endpoint=True)
    noise = rng.lognormal(0.0, noise_sigma, num_requests)
    outputs = task_means[tasks] * (prompt_lens / 128.0) ** 0.3 * noise
    outputs = np.clip(np.rint(outputs), 1, max_output_len).astype(np.int64)
    gaps = (np.zeros(num_requests) if arrival_rate is None
            else rng.exponential(1.0 / arrival_rate, num_requests))
    arrivals = np.cumsum(gaps) - gaps[0]
    requests = []
    for i in range(num_requests):
        from_task = rng.random(prompt_lens[i]) < task_token_fraction
        tokens = np.where(from_task,
                          filler + tasks[i] * task_range + rng.integers(0, task_range,
                                                                        prompt_lens[i]),
                          rng.integers(0, filler, prompt_lens[i]))
        requests.append(Request(id=i, arrival_s=float(arrivals[i]), prompt_len=int(prompt_lens[i]),
                                output_len=int(outputs[i]), prompt_tokens=tokens.astype(np.int32)))
    return requests
