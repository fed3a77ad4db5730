"""What is being served and on what: model shapes and hardware datasheets.

Owns the model-shape type with its one preset table and LLaMA `config.json`
conversion (`model_config`), the accelerator datasheets with theirs
(`hardware`), and what a model takes of a replica's memory: KV bytes per token
and the KV pool that fits (`memory`). Both the real model and the simulator
read their shapes from here.

May import: numpy and the standard library only (no jax, nothing else of `orca_jax`).
"""
