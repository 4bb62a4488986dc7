"""An example of a user's own workload for autotune: ``mypkg.train:workload``.

See ``train.py``, ``studies/mypkg.yaml`` and "Using the config in training" in the README.
"""
