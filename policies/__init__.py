"""Scheduling policies, one module each, registered by name (and the cluster routers).

Importing this package registers the built-in policies; `make_policy` then
loads any of them by name, or a plugin by `package.module:Class` or
`path/to/file.py:Class`. Nothing here imports jax.
"""

from orca_jax import (Policy, PolicyLoadError, make_policy, parse_options, register,
                      registered_policies)
from policies import (edf, lpm, ltr, mlfq, orca, priority, routers, sarathi,  # noqa: F401
                      sjf, srpt, static, vllm, vtc)  # (registers the built-ins)

__all__ = ["Policy", "PolicyLoadError", "make_policy", "parse_options", "register",
           "registered_policies"]
