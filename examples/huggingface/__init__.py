"""A Hugging Face project as autotune takes it, with no glue: ``model.py`` builds a tiny BERT
classifier from its config and holds the ``TrainingArguments``, ``data.py`` makes a dataset of
dicts, ``tune.yaml`` names them, ``train.py`` trains with the result through ``Trainer`` and
``train_accelerate.py`` through accelerate, in a loop of its own.

From the repository root (the folder autotune runs from is importable, so no PYTHONPATH)::

    autotune search examples/huggingface/tune.yaml --budget 40s
    python -m examples.huggingface.train studies/hf-example/best.json
    python -m examples.huggingface.train_accelerate studies/hf-example/best.json

Nothing is downloaded: the model is built from a config, the data is synthetic.
"""
