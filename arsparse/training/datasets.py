"""Token data sets the trainer knows: images from a package registry, tokenised.

A :class:`TokenDataset` names where its images come from, which kind of tokenizer turns them
into tokens, and which training recipe (:data:`arsparse.training.trainer.RECIPES`) fits it.
Palette tokenizers (one token per pixel) need no training; data sets whose images need a VQ
tokenizer will need ``arsparse train tokenizer`` first (not written yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..tokenizers import ImageTokenizer, PaletteTokenizer, make_tokenizer

__all__ = ["DATASETS", "TokenDataset", "fashion_tokens", "load_token_dataset", "make_tokenizer"]


def fashion_tokens(split: str, tokenizer: PaletteTokenizer, root=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST ``split`` as ``(tokens (N, 784) int64, labels (N,) int64)``.

    Pixels are mapped straight from bytes (:meth:`PaletteTokenizer.bytes_to_tokens`), which
    equals ``tokenizer.encode`` of the image in ``[-1, 1]``.
    """
    from ..data.fashion import load_fashion

    if not isinstance(tokenizer, PaletteTokenizer):
        raise ValueError(f"Fashion-MNIST is trained one token per pixel: needs a PaletteTokenizer, got {tokenizer!r}")
    images, labels = load_fashion(split, root=root)  # (N, 28, 28) uint8, (N,)
    return tokenizer.bytes_to_tokens(images).flatten(1), labels


@dataclass(frozen=True)
class TokenDataset:
    """A data set the trainer can use.

    ``tokenizer_kind``: ``"palette"`` (no tokenizer training) or ``"vq"`` (needs a trained VQ).
    ``load(split, tokenizer, root)`` returns ``(tokens, labels)``.
    """

    name: str
    description: str
    recipe: str
    tokenizer_kind: str
    num_classes: int
    grid: tuple[int, int]
    load: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fetch: Callable[..., Any] | None = None


def _fetch_fashion(root=None):
    from ..data.fashion import fetch_fashion

    return fetch_fashion(root)


DATASETS: dict[str, TokenDataset] = {d.name: d for d in [
    TokenDataset("fashion", "Fashion-MNIST (Debian package dataset-fashion-mnist): 60k/10k 28x28 grey images, "
                 "10 classes; one token per pixel", recipe="fashion-c2i", tokenizer_kind="palette",
                 num_classes=10, grid=(28, 28), load=fashion_tokens, fetch=_fetch_fashion),
]}


def load_token_dataset(name: str, tokenizer: ImageTokenizer, root=None, fetch: bool = True):
    """``(train_tokens, train_labels, val_tokens, val_labels)`` of a named data set.

    ``fetch``: install the data when it is missing and that is possible (see
    :func:`arsparse.data.fashion.fetch_fashion`).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    ds = DATASETS[name]
    if fetch and ds.fetch is not None:
        ds.fetch(root)
    tokens, labels = ds.load("train", tokenizer, root=root)
    val_tokens, val_labels = ds.load("test", tokenizer, root=root)
    return tokens, labels, val_tokens, val_labels
