"""Train the example with the config a search wrote, through accelerate, in a loop of your own.

    python -m examples.huggingface.train_accelerate studies/hf-example/best.json --max-steps 200

``autotune.export`` hands ``Accelerator`` the tuned precision (and GradScaler). What accelerate
leaves to the script, it builds as the search did: the optimizer the lr was tuned for, at that lr
(``build_optimizer``); batches of the tuned size, collated as the Trainer collates them; and the
schedule the lr was tuned under (``lr_schedule``: the TrainingArguments' linear decay, with their
warm-up, over the run they describe), stepped after each optimizer step.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import accelerate
import torch
import transformers
from torch.utils.data import DataLoader

import autotune
from examples.huggingface.data import train_set
from examples.huggingface.model import build_model, training_args


def main(
    argv: list[str] | None = None,
    callbacks: list[Callable[[torch.nn.Module, torch.optim.Optimizer], Any]] | None = None,
) -> accelerate.Accelerator:
    """Train with the config; return the Accelerator.

    Args:
        argv: the command line's arguments (default: the process's).
        callbacks: each called as ``callback(model, optimizer)`` once both are prepared, before
            the first step (to register a hook, say).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="best.json of a search, e.g. studies/hf-example/best.json")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps")
    args = parser.parse_args(argv)

    # The project's TrainingArguments say the schedule's run and warm-up. Read before the
    # Accelerator is made: setting up their device resets accelerate's process-wide state.
    hf_args = training_args()
    cfg = autotune.load_config(args.config)
    ex = autotune.export(cfg, "accelerate")
    ex.elsewhere.set_backend_flags()  # TF32 as tuned, cudnn.benchmark=True
    accelerator = accelerate.Accelerator(**ex.kwargs)  # mixed_precision, the tuned GradScaler
    model = build_model()
    optimizer = ex.elsewhere.build_optimizer(model.parameters())  # AdamW at the tuned lr
    # tune.yaml names no collator, so the Trainer's default one batched the search's examples.
    loader = DataLoader(
        train_set(),
        batch_size=ex.elsewhere.batch_size,
        shuffle=True,
        collate_fn=transformers.default_data_collator,
    )
    # The run the TrainingArguments describe (or --max-steps), as the Trainer counts it.
    steps = args.max_steps
    if steps <= 0:
        steps = math.ceil(hf_args.num_train_epochs * len(loader))
    scheduler = transformers.get_scheduler(
        ex.elsewhere.lr_schedule,  # "linear": the schedule the lr was tuned under
        optimizer,
        num_warmup_steps=hf_args.get_warmup_steps(steps),
        num_training_steps=steps,
        scheduler_specific_kwargs=hf_args.lr_scheduler_kwargs,
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for callback in callbacks or []:
        callback(model, optimizer)

    model.train()
    step = 0
    while step < steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % 50 == 0 or step == steps:
                accelerator.print(f"step {step}/{steps}: train_loss {loss.item():.4f}")
            if step == steps:
                break
    return accelerator


if __name__ == "__main__":
    main()
