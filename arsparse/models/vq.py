"""LlamaGen-compatible VQ image tokenizer (VQ-16 and VQ-8).

The module tree mirrors LlamaGen's ``VQModel`` so that its checkpoints load
with identical ``state_dict`` keys and shapes:

* ``encoder``: conv stem, one stage per entry of ``encoder_ch_mult`` (residual
  blocks, spatial attention on the last stage, strided-conv downsampling),
  a middle res/attn/res stack and a projection to ``z_channels``.
* ``quant_conv``: 1x1 conv ``z_channels -> codebook_embed_dim``.
* ``quantize``: nearest-code lookup in an l2-normalised codebook.
* ``post_quant_conv``: 1x1 conv ``codebook_embed_dim -> z_channels``.
* ``decoder``: the mirror image of the encoder with nearest-neighbour
  upsampling and one extra residual block per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
import operator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "VQConfig",
    "VQ_PRESETS",
    "vq_config",
    "VQModel",
    "VectorQuantizer",
    "CODEBOOK_USAGE_WINDOW",
    "check_grid",
]

#: Length of the ``quantize.codebook_used`` buffer stored in LlamaGen checkpoints.
CODEBOOK_USAGE_WINDOW = 65536
_GROUPS = 32  # GroupNorm groups used throughout (LlamaGen's value)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"VQConfig.{name} must be a positive int, got {value!r}")


def _as_mult(name: str, value: Any) -> tuple[int, ...]:
    try:
        mult = tuple(value)
    except TypeError:
        raise ValueError(f"VQConfig.{name} must be a sequence of positive ints, got {value!r}") from None
    if not mult:
        raise ValueError(f"VQConfig.{name} must not be empty")
    for m in mult:
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise ValueError(f"VQConfig.{name} must contain positive ints, got {value!r}")
    return mult


@dataclass(frozen=True)
class VQConfig:
    """Hyper-parameters of a :class:`VQModel`.

    Parameters
    ----------
    codebook_size : int
        Number of codes (the token vocabulary size).
    codebook_embed_dim : int
        Dimension of each code vector.
    codebook_l2_norm : bool
        Normalise codes and features to unit length before lookup.
    encoder_ch_mult, decoder_ch_mult : tuple of int
        Channel multiplier of each resolution stage. Both must have the same
        length; the downsample factor is ``2 ** (len(ch_mult) - 1)``.
    z_channels : int
        Channels of the latent produced by the encoder.
    ch : int
        Base channel width (LlamaGen uses 128). Must be a multiple of 32
        because every normalisation layer is a 32-group GroupNorm.
    num_res_blocks : int
        Residual blocks per encoder stage (the decoder uses one more).
    in_channels : int
        Image channels (3 for RGB); also the decoder's output channels.
    dropout : float
        Dropout probability inside residual blocks, in ``[0, 1)``.
    commit_loss_beta : float
        Weight of the commitment loss returned in training mode.
    """

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    encoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    decoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    ch: int = 128
    num_res_blocks: int = 2
    in_channels: int = 3
    dropout: float = 0.0
    commit_loss_beta: float = 0.25

    def __post_init__(self) -> None:
        for name in ("codebook_size", "codebook_embed_dim", "z_channels", "ch",
                     "num_res_blocks", "in_channels"):
            _check_positive_int(name, getattr(self, name))
        if self.ch % _GROUPS != 0:
            raise ValueError(
                f"VQConfig.ch must be a multiple of {_GROUPS} (GroupNorm uses {_GROUPS} groups), "
                f"got {self.ch}"
            )
        enc = _as_mult("encoder_ch_mult", self.encoder_ch_mult)
        dec = _as_mult("decoder_ch_mult", self.decoder_ch_mult)
        if len(enc) != len(dec):
            raise ValueError(
                "VQConfig.encoder_ch_mult and decoder_ch_mult must have the same length "
                f"(same down/upsampling factor), got {enc} and {dec}"
            )
        # Lists are accepted for convenience but stored as tuples (hashable, immutable).
        object.__setattr__(self, "encoder_ch_mult", enc)
        object.__setattr__(self, "decoder_ch_mult", dec)
        if not isinstance(self.codebook_l2_norm, bool):
            raise ValueError(f"VQConfig.codebook_l2_norm must be a bool, got {self.codebook_l2_norm!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"VQConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.commit_loss_beta, (int, float)) or float(self.commit_loss_beta) < 0:
            raise ValueError(f"VQConfig.commit_loss_beta must be >= 0, got {self.commit_loss_beta!r}")

    @property
    def downsample(self) -> int:
        """Pixels per token along each side, ``2 ** (len(encoder_ch_mult) - 1)``."""
        return 2 ** (len(self.encoder_ch_mult) - 1)


#: Architecture presets matching LlamaGen's ``VQ_models``.
VQ_PRESETS: dict[str, dict[str, Any]] = {
    "VQ-16": dict(encoder_ch_mult=(1, 1, 2, 2, 4), decoder_ch_mult=(1, 1, 2, 2, 4)),
    "VQ-8": dict(encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4)),
}


def vq_config(preset: str = "VQ-16", **overrides: Any) -> VQConfig:
    """Build a :class:`VQConfig` from a named preset.

    Parameters
    ----------
    preset : str
        A key of :data:`VQ_PRESETS` (``"VQ-16"`` or ``"VQ-8"``).
    **overrides
        Any :class:`VQConfig` field. ``ch_mult=`` is accepted as a shorthand
        that sets both ``encoder_ch_mult`` and ``decoder_ch_mult``.

    Returns
    -------
    VQConfig
    """
    if preset not in VQ_PRESETS:
        raise ValueError(f"unknown VQ preset {preset!r}; choose one of {sorted(VQ_PRESETS)}")
    kwargs = dict(VQ_PRESETS[preset])
    if "ch_mult" in overrides:
        mult = overrides.pop("ch_mult")
        kwargs["encoder_ch_mult"] = mult
        kwargs["decoder_ch_mult"] = mult
    valid = {f.name for f in fields(VQConfig)}
    bad = sorted(set(overrides) - valid)
    if bad:
        raise ValueError(f"unknown VQConfig field(s) {bad}; valid fields are {sorted(valid)}")
    kwargs.update(overrides)
    return VQConfig(**kwargs)


# --------------------------------------------------------------------------- #
# Building blocks                                                             #
# --------------------------------------------------------------------------- #
def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(_GROUPS, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """Pre-activation residual block: (GroupNorm, SiLU, conv3x3) x 2 plus skip."""

    def __init__(self, in_ch: int, out_ch: int, dropout: float = 0.0):
        super().__init__()
        self.in_channels, self.out_channels = in_ch, out_ch
        self.norm1 = _norm(in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm2 = _norm(out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        if in_ch != out_ch:
            self.nin_shortcut = nn.Conv2d(in_ch, out_ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, Cin, H, W) -> (B, Cout, H, W)
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = self.nin_shortcut(x) if self.in_channels != self.out_channels else x
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, with residual."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape  # (B, C, H, W)
        y = self.norm(x)

        def tokens(t: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, 1, H*W, C)
            return t.reshape(b, c, h * w).transpose(1, 2).unsqueeze(1)

        # softmax(q k^T / sqrt(C)) v over the H*W positions, one head of width C
        out = F.scaled_dot_product_attention(tokens(self.q(y)), tokens(self.k(y)), tokens(self.v(y)))
        out = out.squeeze(1).transpose(1, 2).reshape(b, c, h, w)  # (B, C, H, W)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Halve the resolution with a stride-2 3x3 conv after right/bottom zero padding."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, H/2, W/2)
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Double the resolution (nearest neighbour) then apply a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, 2H, 2W)
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _stage(res: list[nn.Module], attn: list[nn.Module], resample: nn.Module | None,
           resample_name: str) -> nn.Module:
    """A container with ``res``/``attn`` ModuleLists and an optional resampler."""
    stage = nn.Module()
    stage.res = nn.ModuleList(res)
    stage.attn = nn.ModuleList(attn)
    if resample is not None:
        setattr(stage, resample_name, resample)
    return stage


def _middle(channels: int, dropout: float) -> nn.ModuleList:
    return nn.ModuleList([
        ResnetBlock(channels, channels, dropout),
        AttnBlock(channels),
        ResnetBlock(channels, channels, dropout),
    ])


class Encoder(nn.Module):
    """Image ``(B, in_ch, H, W)`` -> latent ``(B, z_channels, H/f, W/f)``."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        mult = cfg.encoder_ch_mult
        n = len(mult)
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        stages = []
        c_in = cfg.ch
        for level, m in enumerate(mult):
            last = level == n - 1
            res, attn = [], []
            for _ in range(cfg.num_res_blocks):
                res.append(ResnetBlock(c_in, cfg.ch * m, cfg.dropout))
                c_in = cfg.ch * m
                if last:
                    attn.append(AttnBlock(c_in))
            stages.append(_stage(res, attn, None if last else Downsample(c_in), "downsample"))
        self.conv_blocks = nn.ModuleList(stages)
        self.mid = _middle(c_in, cfg.dropout)
        self.norm_out = _norm(c_in)
        self.conv_out = nn.Conv2d(c_in, cfg.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)  # (B, ch, H, W)
        for stage in self.conv_blocks:
            for i, block in enumerate(stage.res):
                h = block(h)
                if len(stage.attn) > 0:
                    h = stage.attn[i](h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, z, H/f, W/f)


class Decoder(nn.Module):
    """Latent ``(B, z_channels, h, w)`` -> image ``(B, out_ch, h*f, w*f)``.

    ``conv_blocks[0]`` is the lowest-resolution stage, as in LlamaGen.
    """

    def __init__(self, cfg: VQConfig):
        super().__init__()
        mult = cfg.decoder_ch_mult
        n = len(mult)
        c_in = cfg.ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c_in, 3, padding=1)
        self.mid = _middle(c_in, cfg.dropout)
        stages = []
        for level in reversed(range(n)):
            res, attn = [], []
            for _ in range(cfg.num_res_blocks + 1):
                res.append(ResnetBlock(c_in, cfg.ch * mult[level], cfg.dropout))
                c_in = cfg.ch * mult[level]
                if level == n - 1:
                    attn.append(AttnBlock(c_in))
            stages.append(_stage(res, attn, Upsample(c_in) if level != 0 else None, "upsample"))
        self.conv_blocks = nn.ModuleList(stages)
        self.norm_out = _norm(c_in)
        self.conv_out = nn.Conv2d(c_in, cfg.in_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)  # (B, ch*mult[-1], h, w)
        for block in self.mid:
            h = block(h)
        for stage in self.conv_blocks:
            for i, block in enumerate(stage.res):
                h = block(h)
                if len(stage.attn) > 0:
                    h = stage.attn[i](h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # (B, C, H, W)


class VectorQuantizer(nn.Module):
    """Nearest-neighbour vector quantiser with a straight-through gradient.

    With ``l2_norm`` both features and codes are projected onto the unit
    sphere, so the nearest code in L2 distance is the one with the largest
    cosine similarity.

    Attributes
    ----------
    embedding : nn.Embedding
        The codebook, ``(codebook_size, embed_dim)``.
    codebook_used : torch.Tensor
        ``(65536,)`` float buffer holding the most recent code ids seen in
        training (LlamaGen's usage statistic; kept for checkpoint parity).
    """

    def __init__(self, codebook_size: int, embed_dim: int, beta: float = 0.25, l2_norm: bool = True):
        super().__init__()
        self.codebook_size, self.embed_dim = codebook_size, embed_dim
        self.beta, self.l2_norm = beta, l2_norm
        self.embedding = nn.Embedding(codebook_size, embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / codebook_size, 1.0 / codebook_size)
            if l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, dim=-1))
        self.register_buffer("codebook_used", torch.zeros(CODEBOOK_USAGE_WINDOW))
        #: Update ``codebook_used`` and return ``usage`` in training mode (it synchronises a GPU
        #: every step; a trainer that counts codes itself turns it off).
        self.track_usage = True

    def codes(self) -> torch.Tensor:
        """The (normalised, if ``l2_norm``) codebook, ``(K, D)``."""
        w = self.embedding.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        """Code vectors for ``indices`` of any shape: ``(...,) -> (..., D)``."""
        return F.embedding(indices, self.codes())

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for each row of ``z`` ``(N, D)`` -> ``(N,)``."""
        codes = self.codes()  # (K, D)
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        # ||z - e||^2 = ||z||^2 + ||e||^2 - 2 z.e
        dist = z.pow(2).sum(1, keepdim=True) + codes.pow(2).sum(1) - 2.0 * (z @ codes.t())  # (N, K)
        return dist.argmin(dim=1)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Quantise a feature map.

        Parameters
        ----------
        z : torch.Tensor
            ``(B, D, h, w)`` features from ``quant_conv``.

        Returns
        -------
        z_q : torch.Tensor
            ``(B, D, h, w)`` quantised features (straight-through gradient).
        indices : torch.Tensor
            ``(B, h*w)`` code ids in raster order.
        losses : dict
            ``{"codebook", "commit", "usage"}`` in training mode (``usage`` only with
            ``track_usage``), else empty.
        """
        b, d, h, w = z.shape
        if d != self.embed_dim:
            raise ValueError(f"expected {self.embed_dim} feature channels, got {d}")
        z = z.permute(0, 2, 3, 1).reshape(b * h * w, d)  # (B*h*w, D)
        if self.l2_norm:
            z = F.normalize(z, dim=-1)
        idx = self.nearest(z)  # (B*h*w,)
        z_q = self.lookup(idx)  # (B*h*w, D)

        losses: dict[str, torch.Tensor] = {}
        if self.training:
            losses["codebook"] = F.mse_loss(z_q, z.detach())
            losses["commit"] = self.beta * F.mse_loss(z, z_q.detach())
            if self.track_usage:
                losses["usage"] = self._record_usage(idx)
        if z.requires_grad:
            z_q = z + (z_q - z).detach()  # straight-through estimator
        z_q = z_q.reshape(b, h, w, d).permute(0, 3, 1, 2)  # (B, D, h, w)
        return z_q, idx.reshape(b, h * w), losses

    @torch.no_grad()
    def _record_usage(self, idx: torch.Tensor) -> torch.Tensor:
        """Push ``idx`` into the rolling ``codebook_used`` window; return the used fraction."""
        window = self.codebook_used
        new = idx[-window.numel():].to(window.dtype)
        n = new.numel()
        window.copy_(torch.cat([window[n:], new]))
        return torch.tensor(torch.unique(window).numel() / self.codebook_size, device=window.device)


# --------------------------------------------------------------------------- #
# Full model                                                                  #
# --------------------------------------------------------------------------- #
class VQModel(nn.Module):
    """LlamaGen VQ autoencoder.

    Parameters
    ----------
    config : VQConfig, optional
        Architecture; defaults to VQ-16 (``vq_config("VQ-16")``).
    """

    def __init__(self, config: VQConfig | None = None):
        super().__init__()
        cfg = config if config is not None else VQConfig()
        if not isinstance(cfg, VQConfig):
            raise ValueError(f"config must be a VQConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg.codebook_size, cfg.codebook_embed_dim,
                                        cfg.commit_loss_beta, cfg.codebook_l2_norm)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    @property
    def downsample(self) -> int:
        """Pixels per token along each side."""
        return self.config.downsample

    def _check_images(self, images: torch.Tensor) -> None:
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be a (B, C, H, W) tensor, got {shape}")
        _, c, h, w = images.shape
        if c != self.config.in_channels:
            raise ValueError(f"images must have {self.config.in_channels} channels, "
                             f"got shape {tuple(images.shape)}")
        f = self.downsample
        if h % f or w % f or h == 0 or w == 0:
            raise ValueError(f"image height and width must be positive multiples of {f}, got {h}x{w}")
        if not images.is_floating_point():
            raise ValueError(f"images must be a floating tensor in [-1, 1], got dtype {images.dtype}")

    def quantize_images(self, images: torch.Tensor):
        """Encode and quantise: ``(B, C, H, W) -> (z_q (B, D, h, w), ids (B, h*w), losses)``."""
        self._check_images(images)
        z = self.quant_conv(self.encoder(images))  # (B, D, h, w)
        return self.quantize(z)

    @torch.no_grad()
    def encode_indices(self, images: torch.Tensor) -> torch.Tensor:
        """Tokenise images.

        Parameters
        ----------
        images : torch.Tensor
            ``(B, C, H, W)`` in ``[-1, 1]``; H and W divisible by ``downsample``.

        Returns
        -------
        torch.Tensor
            ``(B, h*w)`` int64 code ids, raster order, ``h = H // downsample``.
        """
        _, idx, _ = self.quantize_images(images)
        return idx

    def decode_indices(self, indices: torch.Tensor, grid: tuple[int, int], check_range: bool = True) -> torch.Tensor:
        """Decode code ids back to images.

        Parameters
        ----------
        indices : torch.Tensor
            ``(B, N)`` integer ids in ``[0, codebook_size)``.
        grid : tuple of int
            ``(h, w)`` token grid with ``h * w == N``.
        check_range : bool
            Raise a clear error for ids out of range (on a GPU this waits for the device).

        Returns
        -------
        torch.Tensor
            ``(B, C, h*downsample, w*downsample)`` images (not clamped).
        """
        h, w = check_grid(grid)
        if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
            shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise ValueError(f"indices must be a (B, N) tensor, got {shape}")
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise ValueError(f"indices must be an integer tensor, got dtype {indices.dtype}")
        b, n = indices.shape
        if h * w != n:
            raise ValueError(f"grid {h}x{w} = {h * w} tokens does not match indices with N={n}")
        k = self.config.codebook_size
        if check_range and indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= k):
            raise ValueError(
                f"token ids must be in [0, {k}), got range [{int(indices.min())}, {int(indices.max())}]"
            )
        z_q = self.quantize.lookup(indices.long())  # (B, N, D)
        z_q = z_q.reshape(b, h, w, z_q.shape[-1]).permute(0, 3, 1, 2)  # (B, D, h, w); B may be 0
        return self.decoder(self.post_quant_conv(z_q))  # (B, C, H, W)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Reconstruct images for training.

        Returns
        -------
        recon : torch.Tensor
            ``(B, C, H, W)`` reconstruction.
        losses : dict
            ``codebook``, ``commit`` and ``usage`` entries in training mode,
            empty in eval mode.
        """
        z_q, _, losses = self.quantize_images(images)
        recon = self.decoder(self.post_quant_conv(z_q))  # (B, C, H, W)
        return recon, losses


def check_grid(grid: Any) -> tuple[int, int]:
    """Validate a token grid ``(h, w)`` of positive ints and return it as a tuple."""
    try:
        h, w = grid
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (h, w), got {grid!r}") from None
    try:
        if isinstance(h, bool) or isinstance(w, bool):
            raise TypeError
        h, w = operator.index(h), operator.index(w)
    except TypeError:
        raise ValueError(f"grid must contain ints, got {grid!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"grid must contain positive ints, got {grid!r}")
    return h, w
