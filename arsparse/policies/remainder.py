"""The mean-field remainder of an offset policy: one extra attention entry for what a query skips.

An offset policy reads the prompt, the sinks and a few ring offsets; the other image keys the query
could see (causal, past the sinks) are its *remainder*. With ``remainder=True`` each (query, head)
also attends to one entry standing for all of them: key and value the mean of their K and V, logit
``q . k_mean / sqrt(d) + log(count)``, i.e. the softmax weight ``count`` keys equal to their mean
would get together. No entry when ``count`` is 0 (early queries that read every key they can see).

Teacher forcing (:class:`RemainderAttention`) builds the remainder set of every query from the read
masks, O(T^2) per head; the ring cache keeps fp32 running sums of K and V instead and subtracts the
image keys it reads (:func:`remainder_entry`). With grouped-query attention the sets and sums are per
kv head's keys, and every query head takes its own logit against the kv head's mean key.
"""
from __future__ import annotations

import torch


def fold_in(scores, q, k_rest, count):
    """Softmax weights over the read entries and then the remainder entry, in fp32.

    scores (..., n) masked logits of the read entries; q, k_rest (..., D); count (...) the
    remainder's size (0: no entry, weight exactly 0). -> (..., n + 1).
    """
    scale = q.shape[-1] ** -0.5
    count = count.to(scores.dtype)
    extra = (q * k_rest).sum(-1) * scale + count.clamp_min(1).log()
    extra = extra.masked_fill(count == 0, float("-inf"))
    return torch.cat([scores, extra[..., None]], -1).softmax(-1)


def remainder_entry(k_sum, v_sum, count_all, k_read, v_read, read):
    """Mean key and value of the unread image keys from running sums (the cache's form).

    k_sum, v_sum (..., D) fp32 sums over the ``count_all`` image keys past the sinks written so far;
    k_read, v_read (..., n, D) the gathered image keys read, ``read`` (..., n) bool which of them are.
    -> k_rest, v_rest (..., D), count (...) long.
    """
    r = read[..., None].to(torch.float32)
    count = count_all - read.sum(-1)
    n = count.clamp_min(1)[..., None].to(torch.float32)
    return (k_sum - (k_read.float() * r).sum(-2)) / n, (v_sum - (v_read.float() * r).sum(-2)) / n, count


class RemainderAttention:
    """Teacher-forcing backend: the read masks of an offset policy plus the remainder entry.

    ``layers`` (L, H, T, T) read masks; ``first`` the first image position past the sinks (P + S):
    the remainder holds causal keys at or after it that the mask does not read. ``rows``
    (B, 1, T, T) caption masks as in :class:`~arsparse.models.gpt.MaskedAttention` (they restrict
    the prompt, which is never part of the remainder).
    """

    def __init__(self, layers: torch.Tensor, first: int, rows: torch.Tensor | None = None, gqa: bool = False):
        self.layers, self.first, self.rows, self.gqa = layers, first, rows, gqa

    def attend(self, layer: int, q, k, v):
        B, H, T, D = q.shape
        if self.gqa:
            k, v = (x.repeat_interleave(H // k.shape[1], dim=1) for x in (k, v))
        qf, kf, vf = q.float(), k.float(), v.float()
        read = self.layers[layer]  # (H, T, T)
        pos = torch.arange(T, device=q.device)
        rest = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= self.first) & ~read  # (H, T, T)
        count = rest.sum(-1)  # (H, T)
        r = rest.float() / count.clamp_min(1)[..., None]
        k_rest, v_rest = r @ kf, r @ vf  # (B, H, T, D)
        mask = read[None] if self.rows is None else read[None] & self.rows  # (B or 1, H, T, T)
        scores = (qf @ kf.transpose(-1, -2) * D ** -0.5).masked_fill(~mask, float("-inf"))
        w = fold_in(scores, qf, k_rest, count.expand(B, H, T))  # (B, H, T, T + 1)
        return (w[..., :-1] @ vf + w[..., -1:] * v_rest).to(q.dtype)
