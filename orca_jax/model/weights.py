"""Model weights: seeded random init, orbax checkpoints, and local LLaMA-format folders.

A LLaMA-format folder holds `config.json` and either `model.safetensors` or
shards `model-0000k-of-0000n.safetensors` listed in `model.safetensors.index.json`,
with the usual HF tensor names. HF stores linear weights as [out, in]; ours are
[in, out], so they are transposed on load. The q/k projections need no
permutation: `model.apply_rope` uses the same `rotate_half` convention.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from orca_jax.core.step.engine_api import EngineConfigError
from orca_jax.model import llama as model_lib
from orca_jax.specs.model_config import ModelConfig, from_hf_config

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_LAYER_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                  "mlp": ("gate_proj", "up_proj", "down_proj")}


class CheckpointError(EngineConfigError):
    """A checkpoint that cannot be loaded; the message names the file (and the tensor)."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint file or directory that does not exist (also a FileNotFoundError)."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def read_hf_config(directory: str, *, name: Optional[str] = None) -> ModelConfig:
    """The model config of a LLaMA-format folder's `config.json`.

    Args:
      directory: the folder.
      name: the model's name; default: the folder's name.

    Raises:
      CheckpointError: naming the file, when it is unreadable, not JSON, or not a
        LLaMA config.
    """
    path = os.path.join(directory, "config.json")
    if name is None:
        name = os.path.basename(os.path.normpath(directory))
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise MissingCheckpointError(f"{directory}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable model config ({_first_line(e)})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return from_hf_config(raw, name=name)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a LLaMA model config ({_first_line(e)})") from None


def init_params(config: ModelConfig, *, seed: int = 0, dtype: jnp.dtype = jnp.float32
                ) -> nnx.State:
    """Randomly initialised parameters, deterministic in `seed`."""
    return nnx.split(model_lib.init_model(config, seed=seed, dtype=dtype))[1]


def save_params(directory: str, params: nnx.State) -> None:
    """Writes `params` as an orbax checkpoint at `directory` (which must not exist yet)."""
    import orbax.checkpoint as ocp  # only for checkpoints: 0.1 s of every run's start else

    directory = os.path.abspath(directory)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, nnx.to_pure_dict(params))
        checkpointer.wait_until_finished()


def restore_params(directory: str, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32
                   ) -> nnx.State:
    """Reads an orbax checkpoint written by `save_params` for a model of `config`.

    Raises:
      MissingCheckpointError: naming `directory` if it does not exist.
      CheckpointError: naming `directory`, when orbax cannot restore it (an empty or
        foreign folder, a checkpoint of other shapes).
    """
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise MissingCheckpointError(f"orbax checkpoint directory {directory} does not exist")
    if not os.listdir(directory):
        raise CheckpointError(f"{directory}: empty folder; expected an orbax checkpoint or a "
                              f"LLaMA-format folder (config.json + *.safetensors)")
    import orbax.checkpoint as ocp  # only for checkpoints: 0.1 s of every run's start else

    _, abstract = model_lib.abstract_model(config, dtype)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          nnx.to_pure_dict(abstract))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(directory, target)
    except Exception as e:  # noqa: BLE001 -- orbax's errors vary by version; the input is bad
        raise CheckpointError(f"{directory}: not an orbax checkpoint of model {config.name!r} "
                              f"(and no config.json of a LLaMA folder): {_first_line(e)}"
                              ) from e
    nnx.replace_by_pure_dict(abstract, restored)
    return abstract


def hf_tensor_names(config: ModelConfig
                    ) -> Iterator[tuple[str, tuple[Union[str, int], ...], bool]]:
    """Yields (HF tensor name, path in our pure param dict, transposed?) for every tensor."""
    yield "model.embed_tokens.weight", ("embed_tokens", "embedding"), False
    for n in range(config.num_layers):
        for group, projections in _LAYER_LINEARS.items():
            for proj in projections:
                yield f"model.layers.{n}.{group}.{proj}.weight", ("layers", n, proj, "kernel"), True
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"model.layers.{n}.{norm}.weight", ("layers", n, norm, "weight"), False
    yield "model.norm.weight", ("norm", "weight"), False
    if not config.tie_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), True


def _tensor_files(directory: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file holding it."""
    index_path = os.path.join(directory, _INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: unreadable ({_first_line(e)})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: missing the 'weight_map' object")
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}
    single = os.path.join(directory, _SINGLE_FILE)
    if not os.path.exists(single):
        raise MissingCheckpointError(f"{directory}: neither {_SINGLE_FILE} nor {_INDEX_FILE} "
                                     "found")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
    """`safe_open(path)`, its failures (a truncated or foreign file) named by the file."""
    if not os.path.isfile(path):
        raise MissingCheckpointError(f"{path}: no such safetensors file")
    try:
        handle = safe_open(path, framework="np")
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(e)})"
                              ) from None
    with handle as f:
        yield f


def _read_tensor(handle: Any, path: str, name: str) -> np.ndarray:
    """One tensor; a file cut short fails here, named by file and tensor."""
    try:
        return handle.get_tensor(name)
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CheckpointError(f"{path}: tensor {name}: unreadable ({_first_line(e)})") from None


def load_llama_folder(directory: str, *, config: Optional[ModelConfig] = None,
                      dtype: jnp.dtype = jnp.float32) -> tuple[ModelConfig, nnx.State]:
    """Loads a local LLaMA-format folder (no torch: safetensors' numpy reader).

    Args:
      directory: folder with `config.json` and the safetensors file(s).
      config: the model config; None reads it from `config.json`.
      dtype: parameter dtype after loading.

    Returns:
      The config and the parameter state.

    Raises:
      CheckpointError: naming the file and the tensor: a missing tensor, one whose
        shape differs from the expected HF shape, an unreadable file or config.
    """
    if config is None:
        config = read_hf_config(directory)
    _, abstract = model_lib.abstract_model(config, dtype)
    pure = nnx.to_pure_dict(abstract)
    files = _tensor_files(directory)
    with contextlib.ExitStack() as stack:
        handles = {}  # one open reader per shard
        for name, path, transposed in hf_tensor_names(config):
            node = pure
            for key in path[:-1]:
                node = node[key]
            ours = node[path[-1]].shape
            expected = tuple(reversed(ours)) if transposed else tuple(ours)
            if name not in files:
                raise CheckpointError(f"{directory}: missing tensor {name} (expected shape "
                                      f"{expected})")
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(_open_safetensors(file))
            if name not in handles[file].keys():  # the index names a tensor its shard lacks
                raise CheckpointError(f"{file}: missing tensor {name} (expected shape "
                                      f"{expected})")
            array = _read_tensor(handles[file], file, name)
            if tuple(array.shape) != expected:
                raise CheckpointError(f"{file}: tensor {name} has shape {tuple(array.shape)}, "
                                      f"expected {expected}")
            node[path[-1]] = jnp.asarray(array.T if transposed else array, dtype)
    nnx.replace_by_pure_dict(abstract, pure)
    return config, abstract


def load_params(path: str, config: ModelConfig, *, dtype: jnp.dtype = jnp.float32
                ) -> tuple[ModelConfig, nnx.State]:
    """Loads a LLaMA-format folder (it has `config.json`) or an orbax checkpoint directory.

    For an orbax checkpoint `config` gives the shapes; a LLaMA folder brings its own
    config, which is returned in place of `config`.
    """
    if os.path.exists(os.path.join(path, "config.json")):
        return load_llama_folder(path, dtype=dtype)
    return config, restore_params(path, config, dtype=dtype)


def hf_state_dict(config: ModelConfig, params: nnx.State) -> dict[str, np.ndarray]:
    """Our parameters under their HF names and layouts (for writing a LLaMA-format folder)."""
    pure = nnx.to_pure_dict(params)
    out = {}
    for name, path, transposed in hf_tensor_names(config):
        node = pure
        for key in path:
            node = node[key]
        array = np.asarray(node)
        out[name] = np.ascontiguousarray(array.T if transposed else array)
    return out
