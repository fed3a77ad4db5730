"""Scheduling policies, one module each, registered by name.

Importing this package registers the built-in policies; `make_policy` then
loads any of them by name, or a plugin by `package.module:Class` or
`path/to/file.py:Class`. Nothing here imports jax.
"""

from orca_jax.policy import (Policy, PolicyLoadError, make_policy, parse_options, register,
                             registered_policies)
from policies import (edf, ltr, mlfq, orca, priority, sarathi, sjf, srpt, static,  # noqa: F401
                      vllm, vtc)  # (registers the built-ins)

__all__ = ["Policy", "PolicyLoadError", "make_policy", "parse_options", "register",
           "registered_policies"]
