"""An example of a user's own workload for autotune: ``mypkg.train:workload``.

See ``train.py``, ``studies/mypkg.yaml`` and "Your own workload, end to end" in docs/specs.md.
"""
