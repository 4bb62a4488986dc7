"""Built-in workloads. All data is synthetic but learnable, so loss curves mean something."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from autotune.workloads._base import Batch, Workload, synthetic_batches

__all__ = ["BUILTINS", "class_images", "resnet18", "tiny_convnet", "tiny_gpt", "tiny_mlp"]

# Fixed, so every probe of a workload sees the same data distribution whatever its seed.
_DATA_SEED = 1234


def class_images(classes: int, shape: tuple[int, ...], noise: float, signal: float = 0.5):
    """Images drawn around one fixed prototype per class: a classifier can learn them.

    ``signal`` scales the prototypes against unit-variance noise: at 0.5 a convnet's loss falls
    steadily over a few hundred steps instead of dropping to zero in a few dozen.
    """
    gen = torch.Generator().manual_seed(_DATA_SEED)
    protos = signal * torch.randn((classes, *shape), generator=gen)

    def make(batch_size: int, gen: torch.Generator) -> Batch:
        y = torch.randint(0, classes, (batch_size,), generator=gen)
        x = protos[y] + noise * torch.randn((batch_size, *shape), generator=gen)
        return x, y

    return make


def _accuracy(model: nn.Module, batch: Batch) -> float:
    inputs, targets = batch
    with torch.no_grad():
        pred = model(inputs).argmax(-1)
    return (pred == targets).float().mean().item()


def _sgd(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """SGD with momentum, never fused: torch's fused SGD writes its momentum buffer on the
    steps GradScaler skips (:func:`autotune.measure.precision.skip_defect`)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)


def _adamw(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW, fused where every parameter is on CUDA: the fused step takes GradScaler's inf
    check on the device (an unfused one under fp16 reads it back to the host every step) and
    leaves its state untouched on a skipped step."""
    params = list(params)
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=fused or None)


def resnet18() -> Workload:
    """torchvision ResNet-18 at CIFAR size (3×32×32, 10 classes), SGD with momentum.

    The model the usual AMP write-ups measure; base lr 0.1 at batch 128 as in CIFAR recipes.
    """
    from torchvision.models import resnet18 as tv_resnet18

    make = class_images(10, (3, 32, 32), noise=1.0)
    return Workload(
        name="resnet18",
        build_model=lambda: tv_resnet18(num_classes=10),
        make_batches=lambda bs, dev, gen: synthetic_batches(make, bs, dev, gen),
        build_optimizer=_sgd,
        base_lr=0.1,
        base_batch_size=128,
        channels_last=True,
        lr_scaling="linear",
        accuracy=_accuracy,
        description="torchvision resnet18, 3x32x32 synthetic images, 10 classes, SGD momentum",
    )


class _TinyConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def tiny_convnet() -> Workload:
    """A two-layer convnet on 3×16×16 synthetic images: a test-sized conv workload."""
    make = class_images(10, (3, 16, 16), noise=1.0)
    return Workload(
        name="tiny_convnet",
        build_model=_TinyConvNet,
        make_batches=lambda bs, dev, gen: synthetic_batches(make, bs, dev, gen),
        build_optimizer=_sgd,
        base_lr=0.2,
        base_batch_size=32,
        channels_last=True,
        lr_scaling="linear",
        accuracy=_accuracy,
        description="2-layer convnet, 3x16x16 synthetic images, 10 classes, SGD momentum",
    )


def tiny_mlp() -> Workload:
    """A two-layer MLP on 64-feature synthetic vectors: the smallest useful workload."""
    make = class_images(10, (64,), noise=1.5)
    return Workload(
        name="tiny_mlp",
        build_model=lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
        make_batches=lambda bs, dev, gen: synthetic_batches(make, bs, dev, gen),
        build_optimizer=_sgd,
        base_lr=0.05,
        base_batch_size=64,
        lr_scaling="linear",
        accuracy=_accuracy,
        description="2-layer MLP, 64 synthetic features, 10 classes, SGD momentum",
    )


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small causal transformer language model (pre-norm, learned positions, tied head)."""

    def __init__(
        self, vocab: int = 256, context: int = 64, dim: int = 128, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[_Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def _markov_tokens(vocab: int, context: int, branching: int = 4):
    """Token streams from a fixed sparse Markov chain: loss can fall from ln(V) toward ln(4)."""
    gen = torch.Generator().manual_seed(_DATA_SEED)
    successors = torch.randint(0, vocab, (vocab, branching), generator=gen)

    def make(batch_size: int, g: torch.Generator) -> Batch:
        seq = torch.empty(batch_size, context + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, vocab, (batch_size,), generator=g)
        choice = torch.randint(0, branching, (batch_size, context), generator=g)
        for t in range(context):
            seq[:, t + 1] = successors[seq[:, t], choice[:, t]]
        return seq[:, :-1], seq[:, 1:]

    return make


def tiny_gpt() -> Workload:
    """A 2-layer causal transformer LM on synthetic Markov-chain tokens, AdamW."""
    vocab, context = 256, 64
    make = _markov_tokens(vocab, context)
    return Workload(
        name="tiny_gpt",
        build_model=lambda: TinyGPT(vocab=vocab, context=context),
        make_batches=lambda bs, dev, gen: synthetic_batches(make, bs, dev, gen),
        build_optimizer=_adamw,
        base_lr=3e-3,
        base_batch_size=32,
        lr_scaling="sqrt",
        accuracy=_accuracy,
        description=f"2-layer causal transformer, vocab {vocab}, context {context}, AdamW; "
        f"loss floor ln(4)={math.log(4):.2f}",
    )


# Every built-in by its name (BUILTIN_NAMES, which the loader and the service read without torch).
BUILTINS: dict[str, Callable[[], Workload]] = {
    "resnet18": resnet18,
    "tiny_gpt": tiny_gpt,
    "tiny_convnet": tiny_convnet,
    "tiny_mlp": tiny_mlp,
}
