"""Test support, kept out of the product's modules (as optuna keeps ``optuna.testing``).

What the suite and the benchmarks use to stand up real infrastructure for a test: a throwaway
PostgreSQL cluster on 127.0.0.1 (:mod:`autotune.testing.pgtest`). Nothing in the library imports
from here; the workloads that misbehave on purpose stay with the workloads
(:mod:`autotune.workloads.testing`), since a spec names them as a workload reference.
"""
