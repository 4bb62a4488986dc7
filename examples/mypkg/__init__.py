"""An example of a user's own workload for autotune: ``mypkg.train:workload``.

See ``train.py``, ``studies/mypkg.yaml`` and "A workload function, end to end" in docs/own-model.md.
"""
