"""Image tokenizers: images in ``[-1, 1]`` <-> integer token grids.

:class:`ImageTokenizer` is the interface the generation engine relies on;
:class:`VQTokenizer` implements it with a LlamaGen :class:`~arsparse.models.vq.VQModel`.
Tokens are laid out in raster order, ``N = h * w`` per image, and each token
covers a ``downsample x downsample`` pixel patch.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from typing import Any

import torch
from PIL import Image

from .models.vq import VQConfig, VQModel, check_grid, vq_config

__all__ = ["ImageTokenizer", "VQTokenizer", "PaletteTokenizer", "make_tokenizer", "vq_file_config", "to_pil",
           "save_grid"]


#: How far outside ``[-1, 1]`` :meth:`ImageTokenizer.encode` lets a pixel be (float rounding; an
#: 8-bit grey level is 2/255 wide).
PIXEL_TOLERANCE = 1e-3


def check_pixel_range(images: torch.Tensor) -> None:
    """Raise a clear ValueError unless every pixel of ``images`` is finite and in ``[-1, 1]``
    (give or take :data:`PIXEL_TOLERANCE`). Waits for the device once."""
    if not images.numel():
        return
    lo, hi = torch.stack(torch.aminmax(images.detach())).tolist()  # NaN, if any, in both
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"images must be finite floats in [-1, 1], got {'NaN' if math.isnan(lo) else 'infinite'} pixels")
    if lo < -1 - PIXEL_TOLERANCE or hi > 1 + PIXEL_TOLERANCE:
        raise ValueError(f"images must be floats in [-1, 1] (x / 127.5 - 1 for 8-bit pixels x), "
                         f"got range [{lo:.4g}, {hi:.4g}]")


class ImageTokenizer(ABC):
    """Abstract image tokenizer.

    Attributes
    ----------
    vocab_size : int
        Number of distinct token ids; valid ids are ``[0, vocab_size)``.
    downsample : int
        Pixels per token along each side.
    channels : int
        Image channels expected by :meth:`encode`.
    """

    vocab_size: int
    downsample: int
    channels: int

    @abstractmethod
    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        """Implementation of :meth:`encode` on validated input."""

    @abstractmethod
    def _decode(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Implementation of :meth:`decode` on validated input."""

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Tokenise images.

        Parameters
        ----------
        images : torch.Tensor
            ``(B, C, H, W)`` floats in ``[-1, 1]``, with ``C == channels`` and
            ``H``, ``W`` multiples of ``downsample``.

        Returns
        -------
        torch.Tensor
            ``(B, N)`` int64 token ids with ``N = (H // downsample) * (W // downsample)``.
        """
        self.grid_size(self._check_images(images).shape[-2:])
        check_pixel_range(images)
        with torch.inference_mode():
            return self._encode(images).long()

    def decode(self, tokens: torch.Tensor, grid: tuple[int, int], check_range: bool = True) -> torch.Tensor:
        """Turn token ids back into images.

        Parameters
        ----------
        tokens : torch.Tensor
            ``(B, N)`` integer ids in ``[0, vocab_size)``.
        grid : tuple of int
            ``(h, w)`` with ``h * w == N``.
        check_range : bool
            Check that the ids are in range (a clear error otherwise). On a GPU this waits for the
            device; the engine turns it off for the tokens it sampled itself, which are in range by
            construction (see :class:`~arsparse.engine.generator.Generator`).

        Returns
        -------
        torch.Tensor
            ``(B, 3, h * downsample, w * downsample)`` floats clamped to ``[-1, 1]``.
        """
        grid = self._check_tokens(tokens, grid, check_range)
        with torch.inference_mode():
            return self._decode(tokens.long(), grid).clamp(-1.0, 1.0)

    def image_size(self, grid: tuple[int, int]) -> tuple[int, int]:
        """Pixel size ``(H, W)`` of a decoded ``(h, w)`` token grid."""
        h, w = check_grid(grid)
        return h * self.downsample, w * self.downsample

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "ImageTokenizer":
        """Move whatever weights the tokenizer has to ``device`` (and ``dtype``, when given; the
        decoded images come out as floats either way); returns ``self``.

        The default is for tokenizers without weights, which work on any device and dtype.
        """
        return self

    def grid_size(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """Token grid ``(h, w)`` of an ``(H, W)`` image; both must divide by ``downsample``."""
        big_h, big_w = check_grid(tuple(int(v) for v in image_size))
        f = self.downsample
        if big_h % f or big_w % f:
            raise ValueError(f"image size {big_h}x{big_w} must be a multiple of the tokenizer's "
                             f"downsample factor {f} in both dimensions")
        return big_h // f, big_w // f

    def _check_images(self, images: Any) -> torch.Tensor:
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be a (B, C, H, W) tensor, got {got}")
        if images.shape[1] != self.channels:
            raise ValueError(f"images must have {self.channels} channels, got shape {tuple(images.shape)}")
        if not images.is_floating_point():
            raise ValueError(f"images must be floats in [-1, 1], got dtype {images.dtype}")
        return images

    def _check_tokens(self, tokens: Any, grid: Any, check_range: bool = True) -> tuple[int, int]:
        h, w = check_grid(grid)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a (B, N) tensor, got {got}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.shape[1] != h * w:
            raise ValueError(f"grid {h}x{w} = {h * w} tokens does not match tokens with N={tokens.shape[1]}")
        if check_range and tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range [{lo}, {hi}]")
        return h, w


class VQTokenizer(ImageTokenizer):
    """Tokenizer backed by a LlamaGen-layout :class:`VQModel`.

    Parameters
    ----------
    model : VQModel
        The VQ autoencoder; it is put in eval mode.
    """

    def __init__(self, model: VQModel):
        if not isinstance(model, VQModel):
            raise ValueError(f"VQTokenizer needs a VQModel, got {type(model).__name__}")
        self.model = model.eval()
        self.vocab_size = model.config.codebook_size
        self.downsample = model.config.downsample
        self.channels = model.config.in_channels

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, preset: str | VQConfig = "VQ-16", *,
                        key: str | None = None, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "VQTokenizer":
        """Build a VQ model from a preset name or config and load LlamaGen weights.

        Parameters
        ----------
        path : str or os.PathLike
            ``.safetensors`` or ``.pt``/``.pth`` checkpoint (see
            :func:`arsparse.checkpoint.read_state_dict`).
        preset : str or VQConfig
            ``"VQ-16"``, ``"VQ-8"`` or an explicit config.
        key : str, optional
            Sub-dictionary to load (e.g. ``"ema"``).
        device, dtype
            Where and in which precision to place the model.
        """
        from .checkpoint import load_into, read_state_dict

        config = preset if isinstance(preset, VQConfig) else vq_config(preset)
        model = VQModel(config)
        load_into(model, read_state_dict(path, key=key), what="VQ")
        return cls(model.to(device=device, dtype=dtype))

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> "VQTokenizer":
        """Move the VQ model to ``device`` and, when given, ``dtype`` (else its dtype is kept); returns ``self``."""
        self.model.to(device=device, dtype=dtype)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.quant_conv.weight.dtype

    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_indices(images.to(self.device, self.dtype))

    def _decode(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        return self.model.decode_indices(tokens.to(self.device), grid, check_range=False)  # checked by decode()


class PaletteTokenizer(ImageTokenizer):
    """One token per pixel: the grey level, quantised to ``levels`` values.

    A lossless (at 256 levels) or nearly lossless tokenizer for small grey images such as
    Fashion-MNIST, with no weights: the GPT models pixels directly, as PixelCNN-style models do.

    A pixel byte ``v`` in ``[0, 255]`` becomes ``round(v * (levels - 1) / 255)`` and token ``k``
    decodes to the byte ``round(k * 255 / (levels - 1))``. At ``levels=256`` encode and decode
    are exact inverses on 8-bit images.

    Parameters
    ----------
    levels : int
        Number of grey levels = ``vocab_size``, 2..256.

    Notes
    -----
    :meth:`encode` takes ``(B, 1, H, W)`` grey or ``(B, 3, H, W)`` RGB images in ``[-1, 1]``
    (RGB is turned grey by the mean of its channels). :meth:`decode` returns ``(B, 3, H, W)``
    with the grey level copied to the three channels, as the rest of the pipeline expects RGB.
    """

    downsample = 1
    channels = 1

    def __init__(self, levels: int = 256):
        if isinstance(levels, bool) or not isinstance(levels, int) or not 2 <= levels <= 256:
            raise ValueError(f"levels must be an int in [2, 256], got {levels!r}")
        self.levels = levels
        self.vocab_size = levels

    def __repr__(self) -> str:
        return f"PaletteTokenizer(levels={self.levels})"

    def config(self) -> dict[str, Any]:
        """A JSON-able description that :meth:`from_config` turns back into this tokenizer."""
        return {"type": "palette", "levels": self.levels}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PaletteTokenizer":
        if not isinstance(config, dict) or config.get("type", "palette") != "palette":
            raise ValueError(f"not a palette tokenizer config: {config!r}")
        unknown = set(config) - {"type", "levels"}
        if unknown:
            raise ValueError(f"unknown palette tokenizer config keys {sorted(unknown)}")
        return cls(levels=config.get("levels", 256))

    def _check_images(self, images: Any) -> torch.Tensor:
        if isinstance(images, torch.Tensor) and images.dim() == 4 and images.shape[1] == 3:
            return super()._check_images(images[:, :1])  # same checks; RGB is allowed too
        return super()._check_images(images)

    def bytes_to_tokens(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (or integer) grey levels in [0, 255], any shape -> token ids of the same shape."""
        v = pixels.to(torch.float32)
        if self.levels == 256:
            return v.round().clamp(0, 255).long()
        return (v * ((self.levels - 1) / 255.0)).round().clamp(0, self.levels - 1).long()

    def tokens_to_bytes(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids, any shape -> uint8 grey levels of the same shape."""
        return (tokens.to(torch.float32) * (255.0 / (self.levels - 1))).round().clamp(0, 255).to(torch.uint8)

    def _encode(self, images: torch.Tensor) -> torch.Tensor:
        grey = images.float().mean(dim=1) if images.shape[1] == 3 else images[:, 0].float()  # (B, H, W)
        pixels = ((grey.clamp(-1.0, 1.0) + 1.0) * 127.5).round()
        return self.bytes_to_tokens(pixels).flatten(1)  # (B, H*W)

    def _decode(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        h, w = grid
        grey = self.tokens_to_bytes(tokens).float().div(127.5).sub(1.0).view(-1, 1, h, w)  # (B, 1, h, w)
        return grey.expand(-1, 3, h, w).contiguous()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """Convert ``(B, C, H, W)`` images in ``[-1, 1]`` (C = 1 or 3) to PIL images.

    Values outside ``[-1, 1]`` are clamped; ``-1`` maps to 0 and ``1`` to 255.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3):
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a (B, 3, H, W) or (B, 1, H, W) tensor, got {got}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floats in [-1, 1], got dtype {images.dtype}")
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    arr = pixels.permute(0, 2, 3, 1).numpy()  # (B, H, W, C)
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0]) for a in arr]  # mode "L"
    return [Image.fromarray(a) for a in arr]  # mode "RGB"


def make_grid(images: torch.Tensor, nrow: int = 8, padding: int = 2) -> Image.Image:
    """Tile ``(B, C, H, W)`` images in ``[-1, 1]`` into one picture, ``nrow`` per row, with
    ``padding`` black pixels between and around tiles."""
    if isinstance(nrow, bool) or not isinstance(nrow, int) or nrow <= 0:
        raise ValueError(f"nrow must be a positive int, got {nrow!r}")
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be a non-negative int, got {padding!r}")
    tiles = to_pil(images)
    if not tiles:
        raise ValueError("a grid needs at least one image, got an empty batch")
    w, h = tiles[0].size
    cols = min(nrow, len(tiles))
    rows = math.ceil(len(tiles) / cols)
    canvas = Image.new(tiles[0].mode, (cols * (w + padding) + padding, rows * (h + padding) + padding))
    for i, tile in enumerate(tiles):
        r, c = divmod(i, cols)
        canvas.paste(tile, (padding + c * (w + padding), padding + r * (h + padding)))
    return canvas


def save_grid(images: torch.Tensor, path: str | os.PathLike, nrow: int = 8, padding: int = 2) -> Image.Image:
    """Tile images into one picture (:func:`make_grid`) and save it; the format follows the
    extension of ``path``. Returns the grid."""
    canvas = make_grid(images, nrow, padding)
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    canvas.save(path)
    return canvas


def vq_file_config(path: str | os.PathLike) -> dict[str, Any]:
    """The tokenizer description that points at a VQ file: its name (relative to the GPT file) and sha256."""
    import hashlib

    p = os.fspath(path)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"type": "vq", "file": os.path.basename(p), "sha256": h.hexdigest()}


def make_tokenizer(config: dict[str, Any], base_dir: str | os.PathLike | None = None) -> ImageTokenizer:
    """A tokenizer from its JSON description.

    ``{"type": "palette", "levels": 32}``: a :class:`PaletteTokenizer`.
    ``{"type": "vq", "file": "emoji-vq.safetensors", "sha256": ...}``: the VQ in that file
    (relative to ``base_dir``, the folder of the GPT that names it), checked against the hash.
    """
    kind = config.get("type") if isinstance(config, dict) else None
    if kind == "palette":
        return PaletteTokenizer.from_config(config)
    if kind == "vq":
        from .loading import load_vq

        unknown = set(config) - {"type", "file", "sha256"}
        if unknown or not isinstance(config.get("file"), str):
            raise ValueError(f"a VQ tokenizer config needs 'file' (and optionally 'sha256'), got {config!r}")
        path = os.path.join(os.fspath(base_dir) if base_dir is not None else ".", config["file"])
        if not os.path.isfile(path):
            raise ValueError(f"the VQ tokenizer file {path} is missing (the GPT was trained with "
                             f"{config['file']}; put it beside the GPT's weights)")
        if config.get("sha256") and vq_file_config(path)["sha256"] != config["sha256"]:
            raise ValueError(f"{path} is not the VQ the GPT was trained with (sha256 differs from "
                             f"{config['sha256'][:16]}...)")
        return load_vq(path)
    raise ValueError(f"cannot build a tokenizer from {config!r}: known types are 'palette' and 'vq'")
