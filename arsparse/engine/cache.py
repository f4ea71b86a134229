"""The dense static KV cache: the attention backend of the dense engine."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.config import GPTConfig
from ..prompt_mask import attention_mask, prompt_span

KERNELS = ("torch", "triton")


def default_kernel(device: torch.device) -> str:
    """Triton on CUDA when it is installed, else the PyTorch path."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


class CaptionMask:
    """Mixin of the caches: the caption padding mask of their rows (t2i, :mod:`arsparse.prompt_mask`).

    ``prompt_keep`` (rows, P) bool, True at real caption tokens (the PyTorch paths read it);
    ``prompt_span`` (rows, 2) int32, each row's ``[start, end)`` of real tokens (the Triton kernels
    read it); ``prefill_mask`` (rows, 1, P, P), LlamaGen's prefill attention mask. None until a
    mask is set; later masks are copied into the same buffers, so a captured step stays valid.
    """

    P: int
    prompt_keep = prompt_span = prefill_mask = None

    def set_prompt_mask(self, mask: torch.Tensor | None) -> None:
        """(rows, P) bool, each row one contiguous run of True (as :func:`~arsparse.prompt_mask.check_prompt_mask`
        makes it), or None: no padding (buffers, once made, are kept and filled with True)."""
        if mask is None:
            if self.prompt_keep is None:
                return
            mask = torch.ones_like(self.prompt_keep)
        want = (self.rows, self.P)
        if tuple(mask.shape) != want or mask.dtype != torch.bool:
            raise ValueError(f"the cache's prompt mask must be bool {want} (rows, prompt tokens), "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        device = self.pos.device
        mask = mask.to(device)
        state = (mask, prompt_span(mask), attention_mask(mask, self.P))
        if self.prompt_keep is None:
            self.prompt_keep, self.prompt_span, self.prefill_mask = (t.clone() for t in state)
        else:
            for buf, t in zip((self.prompt_keep, self.prompt_span, self.prefill_mask), state):
                buf.copy_(t)

    def _prefill_attention(self, q, k, v, gqa: bool) -> torch.Tensor:
        """Attention among the prompt's positions: causal, or LlamaGen's masked prefill."""
        if self.prefill_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        T = k.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.prefill_mask[:, :, :T, :T], enable_gqa=gqa)


class DenseKVCache(CaptionMask):
    """Static K/V buffers for every layer, written in place; dense attention over the filled prefix.

    ``phase`` is ``"prefill"`` (the prompt, written at positions 0..T-1, causal attention among
    them) or ``"decode"`` (one token at position ``pos``, a device scalar, so the step has static
    shapes and can be captured in a CUDA graph). Decode attention runs through ``kernel``:
    ``"torch"`` (SDPA over the whole buffer with a mask, after writing the token) or ``"triton"``
    (split-KV: one kernel writes the token and reads only positions ``0..pos``).
    """

    def __init__(self, cfg: GPTConfig, rows: int, dtype: torch.dtype, device, max_len: int | None = None,
                 kernel: str = "torch"):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
        self.kernel = kernel
        self.P = cfg.cls_token_num
        self.max_len = max_len or cfg.seq_len
        shape = (cfg.n_layer, rows, cfg.kv_heads, self.max_len, cfg.head_dim)  # (L, B, Hkv, S, D)
        # Zeros, not empty: masked-out slots still meet V in the product, and 0 * NaN is NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self._slots = torch.arange(self.max_len, device=device)
        self.gqa = cfg.kv_heads != cfg.n_head
        self.phase = "prefill"
        self.splits = None
        if kernel == "triton":
            from ..kernels.triton.decode import choose_splits

            self.splits = choose_splits(rows, cfg.kv_heads, self.max_len, torch.device(device))

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.phase == "prefill":
            T = k.shape[2]
            self.k[layer, :, :, :T] = k
            self.v[layer, :, :, :T] = v
            return self._prefill_attention(q, k, v, self.gqa)
        kc, vc = self.k[layer], self.v[layer]  # (B, Hkv, S, D)
        if self.kernel == "triton":
            return self._decode_triton(q, k, v, kc, vc, self.pos)
        kc.index_copy_(2, self.pos.view(1), k)
        vc.index_copy_(2, self.pos.view(1), v)
        mask = (self._slots <= self.pos)[None, None, None, :]  # (1, 1, 1, S)
        if self.prompt_keep is not None:  # padded caption positions are never read
            mask = mask & F.pad(self.prompt_keep, (0, self.max_len - self.P), value=True)[:, None, None, :]
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=self.gqa)

    def _decode_triton(self, q, k, v, kc, vc, pos):
        """One kernel writes k, v (B, Hkv, 1, D) at ``pos`` (a scalar or (B,) tensor) and attends over
        positions 0..pos of kc, vc (B, Hkv, S, D), reading nothing past them (nor padded caption
        positions) -> (B, H, 1, D)."""
        from ..kernels.triton import decode_attention

        span = None if self.prompt_span is None else self.prompt_span[: q.shape[0]]
        return decode_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], kc, vc, pos, num_splits=self.splits,
                                prompt_span=span, prompt_len=self.P).unsqueeze(2)
