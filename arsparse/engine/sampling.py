"""Sampling without a host sync: temperature, top-k, top-p and Gumbel-max with counter-based noise.

The noise for (row, step, vocab id) is a pure function of the row's key and the step, so a request
gives the same image whatever else shares its batch, and the whole step can live in a CUDA graph.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (works on Python ints and int64 tensors holding values < 2**32)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, index: int) -> int:
    """Noise key of image ``index`` of a request with ``seed`` (any Python int)."""
    s = int(seed) & ((1 << 64) - 1)
    k = mix32(s & _M32)
    k = mix32(k ^ (s >> 32))
    return mix32((k + 0x2545F491 * (index + 1)) & _M32)


def uniform_noise(keys: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) uniforms in (0, 1) from keys (B,) int64 and a step (scalar int64 tensor)."""
    ids = mix32(torch.arange(vocab, device=keys.device, dtype=torch.int64) * 0x27D4EB2D & _M32)  # (V,)
    h = mix32((keys + mix32((step + 0x165667B1) & _M32)) & _M32)  # (B,)
    h = mix32(h[:, None] ^ ids[None, :])  # (B, V)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, kmax: int = 0):
    """Mask (to -inf) what top-k and then top-p remove, per row.

    logits (B, V) float; top_k (B,) int64, 0 = off; top_p (B,) float, 1 = off. ``kmax`` is a static
    bound on top_k (the largest in the batch) so the graph shape does not depend on values.
    Top-k keeps every logit >= the k-th largest (ties kept); top-p keeps the smallest prefix of the
    sorted distribution whose mass before each kept token is <= top_p (the first token always stays).
    """
    V = logits.shape[-1]
    if top_k is not None and kmax > 0:
        kmax = min(kmax, V)
        vals = torch.topk(logits, kmax, dim=-1).values  # (B, kmax), descending
        k = torch.where(top_k > 0, top_k.clamp(1, kmax), kmax)
        thr = vals.gather(1, (k - 1)[:, None])  # (B, 1)
        thr = torch.where(top_k[:, None] > 0, thr, torch.full_like(thr, float("-inf")))
        logits = logits.masked_fill(logits < thr, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        remove_sorted = before > top_p[:, None]
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    step: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    kmax: int = 0,
) -> torch.Tensor:
    """Draw one token per row: logits (B, V) -> (B,) int64. Temperature <= 0 means greedy."""
    scaled = logits.float() / temperature.clamp_min(1e-5)[:, None]
    scaled = filter_logits(scaled, top_k, top_p, kmax)
    u = uniform_noise(keys, step, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    gumbel = gumbel * (temperature > 0).to(gumbel.dtype)[:, None]
    return torch.argmax(scaled + gumbel, dim=-1)


def guide(logits: torch.Tensor, cfg_scale: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance: logits (2B, V) = [cond; uncond] -> (B, V).

    ``uncond + scale * (cond - uncond)`` where ``active`` (B,) bool, the cond logits elsewhere.
    """
    cond, uncond = logits.chunk(2, dim=0)
    guided = uncond + cfg_scale[:, None] * (cond - uncond)
    return torch.where(active[:, None], guided, cond)
