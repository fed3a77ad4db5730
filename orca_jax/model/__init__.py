"""The real model and the jitted engine: the only part of `orca_jax` that imports jax.

Owns the Flax LLaMA-style decoder and its paged step (`llama`), sampling,
weights (random, orbax, LLaMA safetensors), tensor-parallel sharding,
`JaxEngine`, which compiles one step per bucket, and `PipelinedJaxEngine`, its
layers in pipeline stages on separate devices. Importing it registers
`orca_jax.core.step.engine_api.StepInputs` as a jax pytree, so the step descriptor
goes to the device as it is.

May import: jax, flax, orbax, safetensors, `pallas_kernels`, `orca_jax.core`,
`orca_jax.specs`.
"""

from orca_jax.model.llama import *  # noqa: F401,F403  (the old `orca_jax.model` module's names)
