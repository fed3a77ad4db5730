"""The ranker's shape and training settings, jax-free (`orca_jax.learned.ranker` trains it).

Apart from the model so that a command defines its flags from them (`experiments.
train_ranker`: the losses, the default step count) without importing jax, optax and
orbax, which its `--help` never needs.
"""

from __future__ import annotations

import dataclasses

LOSSES = ("listmle", "ranknet")
NUM_DENSE = 3  # log prompt length, has-token-ids flag, priority


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankerConfig:
    """Shape of the model and its training.

    Attributes:
      num_token_buckets: hash buckets of prompt token ids.
      embed_dim: width of the token-bucket embedding.
      num_tenant_buckets: hash buckets of tenant names (one-hot).
      hidden_dim: width of the MLP's hidden layer.
      loss: `listmle` (listwise, the paper's) or `ranknet` (pairwise logistic).
      list_size: requests per training list.
      lists_per_step: lists per optimizer step.
      num_steps: optimizer steps.
      learning_rate: Adam's step size.
      weight_decay: AdamW's decoupled weight decay.
      num_calibration_points: quantiles of the score-to-length calibration.
      seed: initialisation and list sampling.
    """

    num_token_buckets: int = 4096
    embed_dim: int = 8
    num_tenant_buckets: int = 8
    hidden_dim: int = 32
    loss: str = "listmle"
    list_size: int = 32
    lists_per_step: int = 16
    num_steps: int = 300
    learning_rate: float = 3e-3
    weight_decay: float = 0.05
    num_calibration_points: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_token_buckets", "embed_dim", "num_tenant_buckets", "hidden_dim",
                     "list_size", "lists_per_step", "num_steps", "num_calibration_points"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(f"RankerConfig.{name} must be an integer >= 1, "
                                 f"got {getattr(self, name)!r}")
        if self.list_size < 2 or self.num_calibration_points < 2:
            raise ValueError("RankerConfig.list_size and num_calibration_points must be >= 2")
        if self.loss not in LOSSES:
            raise ValueError(f"RankerConfig.loss must be one of {LOSSES}, got {self.loss!r}")
        if not (self.learning_rate > 0 and self.weight_decay >= 0):
            raise ValueError(f"RankerConfig: learning_rate must be > 0 and weight_decay >= 0, "
                             f"got {self.learning_rate}, {self.weight_decay}")

    @property
    def num_dense(self) -> int:
        """Width of the dense (non-token) features."""
        return NUM_DENSE + self.num_tenant_buckets
