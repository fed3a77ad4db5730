"""The loop: the `Scheduler`'s two phases (`schedule()` -> `ScheduledStep`,
`update(step, result)`), the `Executor` that runs the steps on the engine with N of
them in flight and keeps the virtual clock, the up-front rejections (`admission`),
the no-progress watchdog, a request's export and import between schedulers
(`request_export`: disaggregation and migration), the leaps over steady decode
steps a simulated run takes (`leap`), and requests ended from outside the plan
(`cancel`: a client gone, an answer cut short by a stop string).

May import: the rest of the core (`requests`, `step`, `kv`, `plans`, `api`).
"""
