"""GPT configuration: one validated dataclass and LlamaGen's size presets as data."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

# LlamaGen's sizes (class-conditional B..XXXL, text-conditional 1B..7B).
GPT_PRESETS: dict[str, dict] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),  # head_dim 100
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
    # Small sizes for tests and the random default bundle (not LlamaGen sizes).
    "GPT-tiny": dict(n_layer=2, n_head=4, dim=64, multiple_of=32),
    "GPT-small": dict(n_layer=6, n_head=6, dim=384, multiple_of=64),
}

MODEL_TYPES = ("c2i", "t2i")

#: LlamaGen's training-time dropouts (fields of :class:`GPTConfig`). They add no weights and act only in
#: ``model.train()``; exported weights carry them as 0 (a shipped file describes an inference model).
DROPOUT_FIELDS = ("token_dropout_p", "attn_dropout_p", "resid_dropout_p", "ffn_dropout_p", "drop_path_rate")


def _round_up(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of a LlamaGen-style GPT.

    The image is a ``grid_h x grid_w`` raster of tokens; the condition takes
    ``cls_token_num`` positions in front of it (1 for a class label, 120 for T5
    caption features).

    Dropouts, all 0 by default and active only in ``model.train()`` (LlamaGen's placement; its
    defaults are 0.1, 0, 0.1, 0.1, 0): ``token_dropout_p`` on the input embeddings (condition and
    tokens), ``attn_dropout_p`` on the attention weights, ``resid_dropout_p`` on the attention
    output (after ``wo``), ``ffn_dropout_p`` on the feed-forward output (after ``w2``),
    ``drop_path_rate`` stochastic depth of each residual branch, rising linearly from 0 at the first
    layer to this at the last. The fused path (:meth:`GPT.fuse`, inference only) has none.
    """

    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    model_type: str = "c2i"
    num_classes: int = 1000
    class_dropout_prob: float = 0.1
    caption_dim: int = 2048
    cls_token_num: int = 1
    grid_h: int = 16
    grid_w: int = 16
    token_dropout_p: float = 0.0
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0
    drop_path_rate: float = 0.0

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"GPTConfig: {msg}")

        for f in ("dim", "n_layer", "n_head", "vocab_size", "grid_h", "grid_w", "cls_token_num", "multiple_of"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                bad(f"{f} must be a positive integer, got {v!r}")
        if self.model_type not in MODEL_TYPES:
            bad(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.dim % self.n_head:
            bad(f"dim ({self.dim}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 4:
            bad(f"head_dim ({self.head_dim}) must be a multiple of 4 for the 2-D RoPE")
        if self.kv_heads < 1 or self.n_head % self.kv_heads:
            bad(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        if self.model_type == "c2i" and self.num_classes < 1:
            bad(f"num_classes must be >= 1 for c2i, got {self.num_classes}")
        if self.model_type == "t2i" and self.caption_dim < 1:
            bad(f"caption_dim must be >= 1 for t2i, got {self.caption_dim}")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            bad(f"class_dropout_prob must be in [0, 1), got {self.class_dropout_prob}")
        for f in DROPOUT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                bad(f"{f} must be a number in [0, 1) (0: off), got {v!r}")

    def without_dropout(self) -> "GPTConfig":
        """This architecture with every dropout 0: what an exported (inference) file describes."""
        return replace(self, **{f: 0.0 for f in DROPOUT_FIELDS})

    # ---- derived sizes -------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def image_tokens(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def seq_len(self) -> int:
        """Positions the model ever sees as input: the prefix plus N - 1 image tokens."""
        return self.cls_token_num + self.image_tokens - 1

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return _round_up(hidden, self.multiple_of)

    @property
    def has_null_class(self) -> bool:
        return self.class_dropout_prob > 0

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one sequence position occupies across all layers."""
        return 2 * self.n_layer * self.kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        d, h = self.dim, self.ffn_hidden
        kv = self.kv_heads * self.head_dim
        per_layer = d * (d + 2 * kv) + d * d + 3 * d * h + 2 * d
        if self.model_type == "c2i":
            cond = (self.num_classes + int(self.has_null_class)) * d
        else:
            cond = self.caption_dim * d + d * d
        return self.n_layer * per_layer + 2 * self.vocab_size * d + d + cond


def grid_for(image_tokens: int) -> tuple[int, int]:
    """Square grid for ``image_tokens`` (LlamaGen's models are square)."""
    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(f"image_tokens={image_tokens} is not a square; give grid_h and grid_w instead")
    return side, side


def gpt_config(preset: str, *, image_tokens: int | None = None, model_type: str = "c2i", **overrides) -> GPTConfig:
    """Build a :class:`GPTConfig` from a preset name plus overrides.

    ``image_tokens`` sets a square grid (256 for 256 px with VQ-16, 576 for 384 px, ...).
    t2i models default to 120 condition tokens, as LlamaGen's.
    """
    if preset not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; choose one of {', '.join(GPT_PRESETS)}")
    kw = dict(GPT_PRESETS[preset])
    kw["model_type"] = model_type
    if model_type == "t2i":
        kw["cls_token_num"] = 120
    if image_tokens is not None:
        kw["grid_h"], kw["grid_w"] = grid_for(image_tokens)
    names = {f.name for f in fields(GPTConfig)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}; allowed: {sorted(names)}")
    kw.update(overrides)
    return GPTConfig(**kw)
