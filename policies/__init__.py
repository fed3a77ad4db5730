"""Scheduling policies, one module each, registered by name (and the cluster routers).

Importing this package registers the built-in policies; `make_policy` then
loads any of them by name, or a plugin by `package.module:Class` or
`path/to/file.py:Class`. Nothing here imports jax.
"""

from orca_jax import (
                      Policy,
                      PolicyLoadError,
                      make_policy,
                      parse_options,
                      register,
                      registered_policies,
)
from policies import (  # noqa: F401
                      autellix,
                      continuum,
                      edf,
                      gateway_routers,
                      lpm,
                      ltr,
                      mlfq,
                      orca,
                      priority,
                      program_routers,
                      rebalancers,
                      router_chain,
                      routers,
                      sarathi,
                      sjf,  # (registers the built-ins)
                      smartspec,
                      srpt,
                      static,
                      vllm,
                      vtc,
)

__all__ = ["Policy", "PolicyLoadError", "make_policy", "parse_options", "register",
           "registered_policies"]
