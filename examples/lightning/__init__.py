"""A Lightning project as autotune takes it, with no glue: ``model.py`` holds a LightningModule,
``data.py`` a LightningDataModule, ``tune.yaml`` names both, ``train.py`` trains with the result.

From the repository root (the folder autotune runs from is importable, so no PYTHONPATH)::

    autotune search examples/lightning/tune.yaml --budget 40s
    python -m examples.lightning.train studies/lightning-example/best.json

In your own project, copy the two modules into your package and name them in the spec as
``mypkg.model:LitClassifier`` and ``mypkg.data:CIFARData``.
"""
