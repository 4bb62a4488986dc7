"""Train the example with the config a search wrote, through Lightning's own Trainer.

    python -m examples.lightning.train studies/lightning-example/best.json --epochs 2

``autotune.export`` hands the Trainer the tuned precision (and GradScaler), and puts the tuned
lr and batch size into the module's and the data module's init args, where the search set them.
"""

from __future__ import annotations

import argparse

import autotune
import lightning as L
from examples.lightning.data import CIFARData
from examples.lightning.model import LitClassifier

# The init args tune.yaml gives (module_args, datamodule_args): train what was tuned.
MODULE_ARGS = {"channels": 16}
DATAMODULE_ARGS = {"samples": 4096}


def main(argv: list[str] | None = None, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    """Train with the config; return the fitted Trainer.

    Args:
        argv: the command line's arguments (default: the process's).
        callbacks: more Lightning callbacks for the Trainer, beside the export's own check.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "config", help="best.json of a search, e.g. studies/lightning-example/best.json"
    )
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps")
    args = parser.parse_args(argv)

    cfg = autotune.load_config(args.config)
    ex = autotune.export(cfg, "lightning", model=LitClassifier, datamodule=CIFARData)
    ex.elsewhere.set_backend_flags()  # TF32 as tuned, cudnn.benchmark=True
    kwargs = ex.kwargs  # precision (or the fp16 plugin with the tuned GradScaler), accelerator
    kwargs["callbacks"] += callbacks or []  # after the export's TunedSettingsCheck
    trainer = L.Trainer(
        **kwargs,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    model = LitClassifier(**{**MODULE_ARGS, **ex.model_kwargs})  # lr=the tuned lr
    data = CIFARData(**{**DATAMODULE_ARGS, **ex.datamodule_kwargs})  # batch_size=the tuned one
    trainer.fit(model, data)
    return trainer


if __name__ == "__main__":
    main()
