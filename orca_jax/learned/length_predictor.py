"""Output-length predictors: the pluggable length source of size-based policies.

SJF and SRPT rank requests by how much work they have left, which needs each
request's output length before it is generated. A predictor turns requests into
predicted output lengths; policies name one by a knob (`predictor="oracle"`)
and get plain integers back, so decision code stays numpy. Learned predictors
(a ranker trained with optax, say) register here under their own name; their
training code may use jax, but `predict_output_len` hands back numpy.

    @register_predictor("prompt_ratio")
    def _make() -> LengthPredictor:
        return PromptRatio(ratio=0.5)
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.request import Request


@runtime_checkable
class LengthPredictor(Protocol):
    """Anything with `predict_output_len`; registered under a name by a factory."""

    def predict_output_len(self, requests: Sequence[Request]) -> NDArray[np.int64]:
        """Predicted output tokens of each request, `[len(requests)]`, each >= 1."""
        ...


_PREDICTORS: dict[str, Callable[[], LengthPredictor]] = {}


def register_predictor(name: str) -> Callable[[Callable[[], LengthPredictor]],
                                              Callable[[], LengthPredictor]]:
    """Decorator registering a zero-argument predictor factory (or class) under `name`."""

    def wrap(factory: Callable[[], LengthPredictor]) -> Callable[[], LengthPredictor]:
        existing = _PREDICTORS.get(name)
        if existing is not None and getattr(existing, "__qualname__", None) != getattr(
                factory, "__qualname__", None):
            raise ValueError(f"length predictor {name!r} is already registered by {existing!r}")
        _PREDICTORS[name] = factory
        return factory

    return wrap


LTR_PREFIX = "ltr:"  # `ltr:DIR` names the ranker saved in DIR (orca_jax.learned.ranker)


def _restore_ranker(directory: str) -> LengthPredictor:
    # Restoring a saved ranker needs jax (orbax), so its module is imported only when such a
    # predictor is built: this is the one route by which a policy reaches the ranker.
    from orca_jax.learned import ranker
    return ranker.Ranker.restore(directory)


def register_ltr_predictor(ranker_dir: str) -> str:
    """Registers the ranker saved at `ranker_dir` as a length predictor; returns its name.

    The name is `ltr:<absolute ranker_dir>`; the registry's factories take no
    arguments, so each saved ranker gets its own name. `get_predictor` restores
    the ranker (orbax) each time it builds one: once per policy.
    """
    directory = os.path.abspath(ranker_dir)
    name = f"{LTR_PREFIX}{directory}"
    register_predictor(name)(functools.partial(_restore_ranker, directory))
    return name


def registered_predictors() -> list[str]:
    """Names of the registered predictors, sorted."""
    return sorted(_PREDICTORS)


def get_predictor(name: str) -> LengthPredictor:
    """A new predictor of the registered name, or `ltr:DIR` for a ranker saved in DIR.

    Raises:
      ValueError: no predictor has that name (the message lists those that do).
    """
    factory = _PREDICTORS.get(name)
    if factory is None and name.startswith(LTR_PREFIX):  # a saved ranker, named by its directory
        factory = _PREDICTORS[register_ltr_predictor(name[len(LTR_PREFIX):])]
    if factory is None:
        raise ValueError(f"unknown length predictor {name!r}; registered: "
                         f"{', '.join(registered_predictors())}")
    return factory()


def checked_predictions(name: str, predictions: NDArray[np.int64],  # [n]
                        num_requests: int) -> NDArray[np.int64]:  # [n]
    """Validates a predictor's answer: one integer per request; clipped to >= 1.

    Raises:
      ValueError: wrong shape or non-finite values, naming the predictor.
    """
    values = np.asarray(predictions)
    if values.shape != (num_requests,):
        raise ValueError(f"length predictor {name!r} returned shape {values.shape}, "
                         f"expected ({num_requests},)")
    if not np.isfinite(values.astype(np.float64)).all():
        raise ValueError(f"length predictor {name!r} returned non-finite lengths")
    # A predicted length below 1 would say a live request has no work left.
    return np.maximum(np.rint(values).astype(np.int64), 1)


@register_predictor("oracle")
class OraclePredictor:
    """The trace's true output length: the upper bound any learned predictor aims at."""

    def predict_output_len(self, requests: Sequence[Request]) -> NDArray[np.int64]:
        return np.fromiter((r.output_len for r in requests), dtype=np.int64, count=len(requests))
