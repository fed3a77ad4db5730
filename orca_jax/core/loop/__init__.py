"""The loop: the `Scheduler`'s two phases (`schedule()` -> `ScheduledStep`,
`update(step, result)`), the `Executor` that runs the steps on the engine with N of
them in flight and keeps the virtual clock, the up-front rejections (`admission`),
the no-progress watchdog, and a request's export and import between schedulers
(`request_export`: disaggregation and migration).

May import: the rest of the core (`requests`, `step`, `kv`, `plans`, `api`).
"""
