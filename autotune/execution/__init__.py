"""Running probes in an isolated worker process.

The search asks a :class:`~autotune.execution.runner.Runner` for each measurement; the runner
here either probes in this process or hands the probe to a persistent worker process
(:mod:`autotune.execution.worker`, started as ``python -m autotune.execution.worker``; the two
speak the typed messages of :mod:`autotune.execution.messages`) that a hard time limit and a
memory limit (:mod:`autotune.execution.limits`) keep from taking the search down with it. The
workload's and the device's facts are asked of that worker too (:mod:`autotune.execution.facts`).
What a probe measures lives one layer down, in :mod:`autotune.measure`.

The parent's side imports no torch: only the worker answers requests
(:mod:`autotune.execution.answers`) and finds facts (:mod:`autotune.execution.collect`).
"""
