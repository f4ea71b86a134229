"""Server settings: one validated dataclass."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    """How much the server takes on.

    ``max_batch``: images decoded at once per policy (the slot pool), at most; ``kv_memory_gb``,
    when given, lowers it to what the policy's KV cache fits in that budget (two cache rows per
    image when the model has guidance). On CUDA without a budget the free memory sets it, as the
    engine's throughput mode does. ``max_queue``: requests waiting per policy before the server
    answers 429. ``max_images``: images per request. ``timeout_s``: a request's deadline unless it
    asks for another (at most ``max_timeout_s``). ``max_policies``: policies (name + parameters)
    with a live slot pool at once; an idle one is closed to make room for a new one.
    ``cuda_graphs``: replay continuous-batching steps from CUDA graphs (CUDA only; one per step
    shape, captured on first use). ``compile``: ``torch.compile`` the transformer blocks for any
    batch size (one compile serves every step width and prefill; slow to build at the first requests).
    ``vq_dtype``: the precision of the image decoder ("fp32", "bf16", "fp16"; None: the serving dtype).
    bf16 halves the decoder's bytes and arithmetic on a GPU (not yet timed); on the shipped emoji VQ
    its images are 59 dB PSNR from the fp32 decoder's (at most 2 of 255 levels apart).
    ``max_body_bytes``: the largest request body (413 past it; None: 1 MiB, plus a t2i model's
    caption features as JSON text). ``body_timeout_s``: how long a request body may stall before
    the server answers 408 and drops it.
    """

    max_batch: int = 32
    kv_memory_gb: float | None = None
    max_queue: int = 64
    max_images: int = 8
    timeout_s: float = 120.0
    max_timeout_s: float = 600.0
    max_policies: int = 2
    cuda_graphs: bool = True
    compile: bool = False
    vq_dtype: str | None = None
    max_body_bytes: int | None = None
    body_timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("max_batch", "max_queue", "max_images", "max_policies"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ServeConfig: {name} must be a positive integer, got {v!r}")
        v = self.max_body_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"ServeConfig: max_body_bytes must be a positive integer or None, got {v!r}")
        for name in ("timeout_s", "max_timeout_s", "body_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ServeConfig: {name} must be a positive number of seconds, got {v!r}")
        for name in ("cuda_graphs", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ServeConfig: {name} must be True or False, got {getattr(self, name)!r}")
        if self.vq_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"ServeConfig: vq_dtype must be fp32, bf16, fp16 or None, got {self.vq_dtype!r}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"ServeConfig: kv_memory_gb must be > 0, got {self.kv_memory_gb!r}")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"ServeConfig: timeout_s ({self.timeout_s}) must be <= max_timeout_s ({self.max_timeout_s})")
        if self.max_images > self.max_batch:
            raise ValueError(f"ServeConfig: max_images ({self.max_images}) must be <= max_batch ({self.max_batch}): "
                             "a request's images decode together")
