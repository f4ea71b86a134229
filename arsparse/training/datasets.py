"""Token data sets the trainer knows: images from a package registry, tokenised.

A :class:`TokenDataset` names where its images come from, which kind of tokenizer turns them
into tokens, and which training recipe (:data:`arsparse.training.trainer.RECIPES`) fits it.
Palette tokenizers (one token per pixel) need no training; data sets whose images need a VQ
tokenizer (emoji) need ``arsparse train tokenizer`` first, and are tokenised once with it (cached).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..tokenizers import ImageTokenizer, PaletteTokenizer, VQTokenizer, make_tokenizer

__all__ = ["DATASETS", "TokenDataset", "emoji_images", "emoji_tokens", "encode_images", "fashion_tokens", "load_token_dataset",
           "make_tokenizer"]


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


def emoji_images(split: str, root=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Emoji images of ``split`` as the GPT is trained on them: ``(images (N, 64, 64, 3) uint8, labels (N,))``.

    ``"train"`` adds a left-right mirror image of every training emoji except those of the
    ``Symbols`` and ``Flags`` categories (where mirroring makes wrong symbols: text, arrows, the
    canton of a flag); ``"test"`` is the held-out emoji, unflipped.
    """
    from ..data.emoji import EMOJI_CATEGORIES, load_emoji

    images, labels = load_emoji(split, cache_dir=root)
    if split != "train":
        return images, labels
    no_flip = [EMOJI_CATEGORIES.index(c) for c in ("Symbols", "Flags")]
    keep = ~torch.isin(labels % len(EMOJI_CATEGORIES), torch.tensor(no_flip))
    return torch.cat([images, images[keep].flip(2)]), torch.cat([labels, labels[keep]])


@contextmanager
def _exact_cuda():
    """Deterministic cuDNN algorithms and no TF32 inside the block, so that a VQ encodes the same images to
    the same tokens in every run on a GPU (a resumed GPT run checks its data's fingerprint)."""
    b = torch.backends
    saved = (b.cudnn.deterministic, b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)
    b.cudnn.deterministic, b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = True, False, False, False
    try:
        yield
    finally:
        b.cudnn.deterministic, b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = saved


def encode_images(tokenizer: ImageTokenizer, images: torch.Tensor, batch_size: int = 256,
                  desc: str | None = None) -> torch.Tensor:
    """(N, H, W, 3) uint8 images -> (N, T) int64 tokens, in batches on the tokenizer's device (a bar if ``desc``).

    In fp32 with deterministic kernels, so the tokens are the same in every run on the same machine.
    """
    from tqdm.auto import tqdm

    parts = []
    with _exact_cuda():
        for i in tqdm(range(0, len(images), batch_size), desc=desc, unit="batch", disable=desc is None):
            x = images[i:i + batch_size].permute(0, 3, 1, 2).float().div(127.5).sub(1.0)  # (B, 3, H, W)
            parts.append(tokenizer.encode(x).cpu())
    return torch.cat(parts) if parts else torch.zeros(0, 0, dtype=torch.long)


def emoji_tokens(split: str, tokenizer: VQTokenizer, root=None, batch_size: int = 256,
                 progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Emoji ``split`` (see :func:`emoji_images`) tokenised by ``tokenizer``: ``(tokens (N, T), labels (N,))``.

    Tokens are computed once per VQ (on the tokenizer's device) and cached beside the data as
    ``tokens-<split>-<hash of the VQ weights>.pt``.
    """
    from ..data.emoji import emoji_cache_dir
    from .trainer import _fingerprint

    if not isinstance(tokenizer, VQTokenizer):
        raise ValueError(f"emoji images are tokenised by a trained VQ: needs a VQTokenizer, got {tokenizer!r}")
    key = _fingerprint(*tokenizer.model.state_dict().values())[:16]
    cache = emoji_cache_dir(root) / f"tokens-{split}-{key}.pt"
    if cache.is_file():
        d = torch.load(cache, map_location="cpu", weights_only=True)
        return d["tokens"].long(), d["labels"]
    images, labels = emoji_images(split, root)
    tokens = encode_images(tokenizer, images, batch_size, desc=f"tokenise emoji {split}" if progress else None)
    tmp = cache.with_name(cache.name + ".tmp")
    small = torch.int16 if tokenizer.vocab_size <= torch.iinfo(torch.int16).max else torch.int32
    torch.save({"tokens": tokens.to(small), "labels": labels}, tmp)
    os.replace(tmp, cache)
    return tokens.long(), labels


@dataclass(frozen=True)
class TokenDataset:
    """A data set the trainer can use.

    ``tokenizer_kind``: ``"palette"`` (no tokenizer training) or ``"vq"`` (needs a trained VQ, from the
    VQ recipe ``tokenizer_recipe`` of :data:`arsparse.training.vq_trainer.VQ_RECIPES`).
    ``image_size``: pixels per side. ``load(split, tokenizer, root)`` returns ``(tokens, labels)``.
    """

    name: str
    description: str
    recipe: str
    tokenizer_kind: str
    num_classes: int
    image_size: int
    load: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fetch: Callable[..., Any] | None = None
    tokenizer_recipe: str | None = None


def _fetch_fashion(root=None):
    from ..data.fashion import fetch_fashion

    return fetch_fashion(root)


def _fetch_emoji(root=None):
    from ..data.emoji import load_emoji_table

    load_emoji_table(root, fetch=True, quiet=False)


DATASETS: dict[str, TokenDataset] = {d.name: d for d in [
    TokenDataset("fashion", "Fashion-MNIST (Debian package dataset-fashion-mnist): 60k/10k 28x28 grey images, "
                 "10 classes; one token per pixel", recipe="fashion-c2i", tokenizer_kind="palette",
                 num_classes=10, image_size=28, load=fashion_tokens, fetch=_fetch_fashion),
    TokenDataset("emoji", "colour emoji (npm emoji-datasource-google/-twitter): 7.6k 64x64 RGB images, 18 classes "
                 "(category x style); through a VQ trained here, 32x32 tokens", recipe="emoji-c2i",
                 tokenizer_kind="vq", num_classes=18, image_size=64, load=emoji_tokens, fetch=_fetch_emoji,
                 tokenizer_recipe="emoji-vq"),
]}


def load_token_dataset(name: str, tokenizer: ImageTokenizer, root=None, fetch: bool = True):
    """``(train_tokens, train_labels, val_tokens, val_labels)`` of a named data set.

    ``fetch``: install the data when it is missing and that is possible (see
    :func:`arsparse.data.fashion.fetch_fashion`, :func:`arsparse.data.emoji.fetch_emoji`).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    ds = DATASETS[name]
    if fetch and ds.fetch is not None:
        ds.fetch(root)
    tokens, labels = ds.load("train", tokenizer, root=root)
    val_tokens, val_labels = ds.load("test", tokenizer, root=root)
    return tokens, labels, val_tokens, val_labels
