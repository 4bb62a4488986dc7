"""A tiny sequence classifier (BERT with 2 layers, hidden size 32) and the TrainingArguments it
was developed with: autotune reads the base learning rate and batch size from them, and builds
the optimizer and schedule ``Trainer`` would build from them."""

from __future__ import annotations

import transformers

VOCAB, CONTEXT, CLASSES = 64, 32, 4


def build_model() -> transformers.BertForSequenceClassification:
    """A fresh, randomly initialised model built from its config; nothing is downloaded."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=CONTEXT,
        num_labels=CLASSES,
    )
    return transformers.BertForSequenceClassification(config)


def training_args(output_dir: str = "studies/hf-example/trainer") -> transformers.TrainingArguments:
    """How the model is trained: AdamW (the Trainer's default) at 1e-3, 32 sequences a step,
    a linear decay over 3 epochs."""
    return transformers.TrainingArguments(
        output_dir=output_dir,
        learning_rate=1e-3,
        per_device_train_batch_size=32,
        num_train_epochs=3,
        report_to=[],
    )
