"""The program workload's shapes and their defaults, without the generator.

The run's spec (`orca_jax.runner.spec`) names them in its knobs and their help, so
every run imports them; the generator (`programs`), with its dataclasses, is imported
by a run of programs only (`runner.build.build_workload`).
"""

from __future__ import annotations

PROGRAM_SHAPES = ("copilot", "parallel")

# The Copilot coding-agent traces of 2026 (Azure/AzurePublicDataset,
# GitHubCopilotCodingAgentDataset2026.md): 3.95 turns per session and 7.83 LLM calls per
# turn; prompts outweigh completions about 128 to 1 (631B prompt tokens, 541B of them
# cached). Lognormal, as session and length counts are heavy-tailed; the absolute sizes
# and times are ours, scaled so a session fits an 8K context before it compacts.
COPILOT_DEFAULTS = {
    "turns": "lognormal:3.95:0.8",
    "calls_per_turn": "lognormal:7.83:1",
    "first_prompt": "lognormal:2048:0.5",
    "prompt_growth": "lognormal:192:1",
    "completion_len": "lognormal:35:1",
    "tool_ms": "lognormal:3000:1.2",
    "turn_gap_ms": "lognormal:20000:1",
}
