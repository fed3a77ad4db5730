"""Learned parts that hand policies plain numbers: length predictors and the ranker.

Owns the length-predictor registry (`length_predictor`, jax-free, which loads
a trained ranker on demand) and the learning-to-rank model trained with optax
and saved with orbax (`ranker`). The import points one way: `length_predictor`
imports `ranker` lazily (the one route to it); `ranker` does not import
`length_predictor`.

May import: `orca_jax.core`, `orca_jax.specs`, and jax/optax/orbax in `ranker` only.
"""
