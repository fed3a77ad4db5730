"""Where the reproductions find the public traces they read (docs/traces.md).

The traces (the Azure LLM inference traces 2023, the arXiv summarization lengths,
Mooncake's conversation trace) are not in the repository: they sit in one folder,
`$ORCA_JAX_TRACES` where that variable is set, else `shared/traces` beside the
repository's root (the team's layout: `../shared/traces` from the root). The folder is
found from this file, not from the working directory, so a reproduction run from
anywhere finds it; a reproduction's own flag (`--trace`, `--lengths_file`) names another
file instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from orca_jax.workloads.traces import TraceError

TRACES_ENV = "ORCA_JAX_TRACES"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACES_DIR = REPO_ROOT.parent / "shared" / "traces"

AZURE_CONV = "azure_conv_2023.csv"
AZURE_CODE = "azure_code_2023.csv"
ARXIV_LENGTHS = "arxiv_summarization_lengths.csv"
MOONCAKE = "mooncake_conversation_2025.jsonl"

_VIDUR = ("data/processed_traces/ of github.com/microsoft/vidur (MIT), which derives it from "
          "{what}")
SOURCES = {
    AZURE_CONV: _VIDUR.format(what="the Azure LLM inference trace 2023 (conversation) of "
                                   "github.com/Azure/AzurePublicDataset"),
    AZURE_CODE: _VIDUR.format(what="the Azure LLM inference trace 2023 (code) of "
                                   "github.com/Azure/AzurePublicDataset"),
    ARXIV_LENGTHS: _VIDUR.format(what="the arXiv summarization data set"),
    MOONCAKE: ("FAST25-release/traces/conversation_trace.jsonl of github.com/kvcache-ai/"
               "Mooncake (Apache-2.0)"),
}


def traces_dir() -> Path:
    """The folder of the traces: `$ORCA_JAX_TRACES` where set (and not empty), else
    `shared/traces` beside the repository's root."""
    given = os.environ.get(TRACES_ENV, "").strip()
    return Path(given).expanduser() if given else DEFAULT_TRACES_DIR


def flag_help(what: str, name: str) -> str:
    """The help of a flag that names trace `name` (`what`: what the file is)."""
    return f"{what} (default: {name} in ${TRACES_ENV}, else in shared/traces beside the repository)"


def trace_path(name: str, given: Optional[str] = None, *, flag: str = "--trace") -> str:
    """The file a reproduction reads for trace `name`.

    Args:
      name: the trace's file name in the traces folder (`SOURCES`' keys).
      given: the file the user named with `flag` (None: `name` in `traces_dir()`).
      flag: the reproduction's flag that names another file (for the errors).

    Returns:
      `given`, else `traces_dir() / name`.

    Raises:
      TraceError: `given` is not a file (before a reproduction's minutes of runs fail on
        it one by one); or `given` is None and the traces folder holds no `name`: one line
        naming the file looked for, `$ORCA_JAX_TRACES` and `flag`, and where to get it.
    """
    if given is not None:
        if not Path(given).is_file():
            raise TraceError(f"{flag}={given}: no such file")
        return given
    path = traces_dir() / name
    if path.is_file():
        return str(path)
    where = (f"${TRACES_ENV}={os.environ[TRACES_ENV].strip()}"
             if os.environ.get(TRACES_ENV, "").strip()
             else f"${TRACES_ENV} unset, so the folder beside the repository")
    source = SOURCES.get(name, "see docs/traces.md")
    raise TraceError(f"trace {name} not found: no {path} ({where}); set {TRACES_ENV} to the "
                     f"folder that holds it or name the file with {flag}; get it from "
                     f"{source} (docs/traces.md)")


if __name__ == "__main__":  # a helper module: `--help` says so, not nothing
    from experiments.cli_errors import not_a_command
    not_a_command("experiments.reproduce.trace_files",
                  "where the reproductions find their traces",
                  "python -m experiments.reproduce.distserve --help (or another: "
                  "docs/reproductions.md)")
