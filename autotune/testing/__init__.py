"""Test support, kept out of the product's modules (as optuna keeps ``optuna.testing``).

What the suite and the benchmarks use and the library never imports: a throwaway PostgreSQL
cluster on 127.0.0.1 (:mod:`autotune.testing.pgtest`), workloads that misbehave on purpose, each
named by a spec as a workload reference (:mod:`autotune.testing.workloads`, e.g.
``autotune.testing.workloads:fp16_overflow``), and the command line with a colleague's job faked
on every device (:mod:`autotune.testing.busy`).
"""
