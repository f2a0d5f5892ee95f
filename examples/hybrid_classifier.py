"""Whale's flagship hybrid: a convolutional feature extractor under ``replicate`` and a very wide
classifier plus softmax cross-entropy under ``split`` (sharded over the classes).

The scopes are opened *inside* ``forward`` (forward-time scopes), the other way to annotate:

    with wl.replicate():  features = self.features(images)    -> TaskGraph 0, data parallel
    with wl.split():      logits = self.classifier(features)   -> TaskGraph 1, class-sharded

GroupNorm rather than BatchNorm: batch statistics over a rank's uneven share would make each
replica normalise differently from single-process training on the global batch.

``num_classes`` defaults to 20,000 so ``build()`` trains a few dozen steps on a CPU in seconds;
Whale's setting is ``build(num_classes=100_000)`` (capture runs on meta tensors, so inspecting or
planning that size needs no memory). The loss is a plain ``F.cross_entropy``, which lets the
runtime keep the logits class-sharded and compute the softmax without gathering them.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import whalelike as wl
from whalelike.workload import Workload


class HybridClassifier(nn.Module):
    def __init__(self, num_classes: int = 20_000, width: int = 16, image_size: int = 32, feature_dim: int = 256):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"HybridClassifier: image_size must be a multiple of 4, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.GroupNorm(4, width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.GroupNorm(4, 2 * width), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.embed = nn.Linear(2 * width * (image_size // 4) ** 2, feature_dim)
        self.classifier = nn.Linear(feature_dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with wl.replicate():
            features = F.relu(self.embed(self.features(images).flatten(1)))
        with wl.split():
            return self.classifier(features)


def build(num_classes: int = 20_000, width: int = 16, image_size: int = 32, feature_dim: int = 256,
          batch_size: int = 8, seed: int = 0) -> Workload:
    """The model, an example batch of images, softmax cross-entropy, and synthetic labelled images."""
    torch.manual_seed(seed)
    model = HybridClassifier(num_classes, width, image_size, feature_dim)
    # A learnable synthetic corpus: 64 classes spread over the label space, each with a fixed
    # prototype image; a sample is its class's prototype plus noise.
    corpus = torch.Generator().manual_seed(seed + 1)
    classes = torch.randperm(num_classes, generator=corpus)[:64]
    prototypes = torch.randn(len(classes), 3, image_size, image_size, generator=corpus)

    def make_batch(num_samples: int, generator: torch.Generator):
        which = torch.randint(0, len(classes), (num_samples,), generator=generator)
        images = prototypes[which] + 0.1 * torch.randn(num_samples, 3, image_size, image_size, generator=generator)
        return (images,), classes[which]

    (example,), _ = make_batch(batch_size, torch.Generator().manual_seed(seed))
    return Workload(model=model, example_args=(example,), loss_fn=F.cross_entropy, make_batch=make_batch)


if __name__ == "__main__":
    w = build()
    print(wl.capture(w.model, w.example_args))
