"""What a study stores, and how it is opened.

An autotune study is an Optuna study in a storage (SQLite, or PostgreSQL shared by many boxes).
This layer is the one place that knows its shape: opening it with its resume check, heartbeats
and once-per-study claims (:mod:`autotune.study.storage`), every key a study stores
(:mod:`autotune.study.study_keys`), the typed reads and writes of them
(:mod:`autotune.study.store`), the record each trial stores (:mod:`autotune.study.trials`),
the fp32 reference of a machine and device (:mod:`autotune.study.reference`) and the crowned
tuned config (:mod:`autotune.study.crown`). The named values it stores (Outcome, Role, Phase,
StudyState) stay at the top, in :mod:`autotune.enums`: a probe's result names its outcome too,
and measurement sits below this layer. The search writes through it; the report, the service
and the CLI read through it.
"""
