"""Sequence geometry: where each image token sits on the 2-D grid. One source of truth."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Map sequence positions to image-grid cells.

    Positions ``0 .. prefix_len-1`` hold the condition (prompt) tokens; image token
    ``(r, c)`` sits at ``prefix_len + r * row_stride + c``. ``row_stride`` is
    ``grid_w`` plus any end-of-line tokens the model inserts (LlamaGen has none).
    """

    prefix_len: int
    grid_h: int
    grid_w: int
    row_stride: int | None = None

    def __post_init__(self):
        if self.row_stride is None:
            object.__setattr__(self, "row_stride", self.grid_w)
        for name in ("grid_h", "grid_w", "row_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout: {name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"Layout: prefix_len must be >= 0, got {self.prefix_len}")
        if self.row_stride < self.grid_w:
            raise ValueError(f"Layout: row_stride ({self.row_stride}) must be >= grid_w ({self.grid_w})")

    @property
    def image_tokens(self) -> int:
        return self.grid_h * self.grid_w

    def position(self, row: int, col: int) -> int:
        return self.prefix_len + row * self.row_stride + col
