"""Caption padding masks of text-to-image (t2i) prompts, as LlamaGen uses them.

LlamaGen pads a caption's T5 features to ``cls_token_num`` (120) tokens and passes ``emb_masks``
(B, P), True at the real tokens. Its sampler moves the real tokens to the end (left padding) and
zeroes the padded features; its ``generate()`` then lets no query attend to a padded prompt key,
except that every query attends to itself (so a padded query row of the prefill is never empty).
Positions, and so RoPE, are those of the padded sequence. The unconditional rows of guidance use
the same mask as their conditional rows.

Here a mask is a (B, P) bool tensor, True = a real caption token. The Triton kernels read it as
one ``[start, end)`` span of real tokens per row (two int32 loads per program), so a mask must be
one contiguous run of True: left padding (LlamaGen's default), right padding (its
``--no-left-padding``) or none. Anything else is rejected by :func:`check_prompt_mask`.
"""
from __future__ import annotations

import torch


def check_prompt_mask(mask, batch: int, prompt_len: int, model_type: str) -> torch.Tensor | None:
    """A caption mask -> a (batch, prompt_len) bool tensor, or None when there is no padding.

    Accepts a bool tensor (or array) or 0/1 integers, True/1 at real caption tokens. An all-True mask
    is the same as none and returns None, so it runs the unmasked path. Raises ValueError for a
    c2i model, a wrong shape or dtype, a row with no real token, or a row whose real tokens are not
    one contiguous run.
    """
    if mask is None:
        return None
    if model_type != "t2i":
        raise ValueError("prompt_mask is for text-conditional (t2i) models, whose prompt is padded caption features; "
                         f"this is a {model_type} model (leave prompt_mask=None)")
    mask = torch.as_tensor(mask)
    if mask.dtype != torch.bool:
        fractional = mask.is_floating_point() or mask.is_complex()
        if fractional or (mask.numel() and not ((mask == 0) | (mask == 1)).all()):
            raise ValueError("prompt_mask must be bool (or 0/1 integers), True at real caption tokens; got "
                             f"{mask.dtype}" + ("" if fractional else " with values other than 0/1"))
        mask = mask.bool()
    if tuple(mask.shape) != (batch, prompt_len):
        raise ValueError(f"prompt_mask must be (B, P) = ({batch}, {prompt_len}): one row per condition, one column per "
                         f"prompt token; got {tuple(mask.shape)}")
    n = mask.sum(1)
    empty = (n == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt_mask rows {empty} have no real caption token; every row needs at least one True")
    start = mask.int().argmax(1)
    run = torch.arange(prompt_len, device=mask.device)[None, :]
    contiguous = mask == ((run >= start[:, None]) & (run < (start + n)[:, None]))
    holes = (~contiguous.all(1)).nonzero().flatten().tolist()
    if holes:
        raise ValueError(f"prompt_mask rows {holes} are not one contiguous run of True: allowed are left padding "
                         "(False..False True..True, LlamaGen's default), right padding (True..True False..False) "
                         "or no padding")
    return None if bool(mask.all()) else mask


def prompt_span(mask: torch.Tensor) -> torch.Tensor:
    """(B, P) bool mask (one run of True per row) -> (B, 2) int32 ``[start, end)`` of the real tokens."""
    n = mask.sum(1)
    start = mask.int().argmax(1)
    return torch.stack([start, start + n], dim=1).to(torch.int32)


def attention_mask(mask: torch.Tensor, T: int) -> torch.Tensor:
    """LlamaGen's attention mask over sequence positions 0..T-1 -> (B, 1, T, T) bool, True = attend.

    Causal; no query attends to a padded prompt key, except that every query attends to itself.
    """
    B, P = mask.shape
    pos = torch.arange(T, device=mask.device)
    causal = pos[None, :] <= pos[:, None]  # (T, T): query row, key column
    real = torch.ones(B, T, dtype=torch.bool, device=mask.device)
    real[:, :P] = mask  # keys that may be read: real prompt tokens and every image token
    itself = torch.eye(T, dtype=torch.bool, device=mask.device)
    return ((causal[None] & real[:, None, :]) | itself[None])[:, None]


def pad_captions(features: torch.Tensor, mask: torch.Tensor | None, prompt_len: int,
                 left_padding: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Caption features and their mask as LlamaGen's sampler hands them to ``generate()``.

    ``features`` (B, n, C) with n <= ``prompt_len``: T5 outputs, padded or not. ``mask`` (B, n) bool
    or 0/1 (True at real tokens; None: every token is real). Each row's real tokens (one contiguous
    run) move to the end of ``prompt_len`` positions (``left_padding``, LlamaGen's default) or to the
    start (its ``--no-left-padding``); padded features become zeros. Returns (features (B, P, C)
    float32, mask (B, P) bool).
    """
    B, n, C = features.shape
    if n > prompt_len:
        raise ValueError(f"caption features have {n} tokens, more than the model's prompt of {prompt_len}")
    if mask is None:
        mask = torch.ones(B, n, dtype=torch.bool)
    mask = check_prompt_mask(mask, B, n, "t2i")
    if mask is None:
        mask = torch.ones(B, n, dtype=torch.bool)
    out = torch.zeros(B, prompt_len, C, dtype=torch.float32)
    keep = torch.zeros(B, prompt_len, dtype=torch.bool)
    for b in range(B):
        real = features[b][mask[b]].float()  # (k, C), in order
        k = real.shape[0]
        at = slice(prompt_len - k, prompt_len) if left_padding else slice(0, k)
        out[b, at], keep[b, at] = real, True
    return out, keep
