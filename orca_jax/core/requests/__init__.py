"""Requests and what a run records of them: `Request` and its states, the
`RequestTable` (every request's state as numpy arrays, indexed by arrival order),
the run's step and token logs (`RunRecord`: its steps packed as `StepLogs`, its tokens
counted as `TokenStats` or logged each) and a finished run's value (`RunResult`).

The bottom of the core: KV memory, the plans and their checks and the view all
read the table, so it sits below them.

May import: numpy and the standard library only.
"""
