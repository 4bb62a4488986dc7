"""Train the example with the config a search wrote, through transformers' own Trainer.

    python -m examples.huggingface.train studies/hf-example/best.json --max-steps 200

The TrainingArguments are the project's own (``model.training_args``) with what
``autotune.export`` hands over laid on top: the tuned precision and GradScaler, learning rate,
batch size and the optimizer settings the lr was tuned for.
"""

from __future__ import annotations

import argparse
import dataclasses

import transformers

import autotune
from examples.huggingface.data import train_set
from examples.huggingface.model import build_model, training_args


def main(
    argv: list[str] | None = None, callbacks: list[transformers.TrainerCallback] | None = None
) -> transformers.Trainer:
    """Train with the config; return the trained Trainer.

    Args:
        argv: the command line's arguments (default: the process's).
        callbacks: more callbacks for the Trainer.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="best.json of a search, e.g. studies/hf-example/best.json")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps")
    parser.add_argument("--output-dir", default="studies/hf-example/trainer")
    args = parser.parse_args(argv)

    cfg = autotune.load_config(args.config)
    ex = autotune.export(cfg, "hf")
    tuned = dataclasses.replace(
        training_args(args.output_dir), **ex.kwargs, max_steps=args.max_steps, save_strategy="no"
    )
    ex.elsewhere.set_backend_flags()  # after TrainingArguments, whose tf32= sets half of them
    trainer = transformers.Trainer(
        model=build_model(), args=tuned, train_dataset=train_set(), callbacks=callbacks
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
