"""What a finished run says: metrics, summaries, results files, sweeps and plots.

Owns the serving metrics (`metrics`), a run's summary and its rows
(`summary`), the folder a run writes them into, staged and moved into place
whole (`run_folder`), a command's fresh default folder and the `runs/latest` link to
it (`latest_link`), the resumable sweep store (`sweep_store`), the lock
every writer of a results folder holds (`folder_lock`) and the figures
(`plots`). Everything here reads a finished run's value, never a live
scheduler (the runner streams a live run's rows into its folder).

May import: numpy, `orca_jax.core`, and matplotlib lazily (inside the drawing functions).
"""

from orca_jax.results.summary import *  # noqa: F401,F403  (the old `orca_jax.results` module's names)
