"""Calibration shared by the head-wise policies (:mod:`arsparse.policies.headwise`).

Two kinds, both read the model's own attention:

* **Online head typing** (HeadKV, SSD), inside the captured decode step: during the first
  ``calib_rows`` image rows each (sequence, layer, kv head) accumulates how much of every query's
  attention falls on its neighbourhood (:func:`locality`); at the end of calibration the head is
  *local* when its mean is above a threshold (:func:`classify`) and the layer's budget is split
  between local and broad heads (:func:`allocate`). Tensor ops only.
* **Offline offset statistics** (diagonal-adaptive), once per model, on the host: decode the
  first rows densely (:func:`sample_prefix`), then run them through the model with
  :class:`OffsetMassCapture`, an attention backend that computes attention itself and keeps, per
  (layer, head), only the attention mass by backward offset, never the T x T maps.
"""
from __future__ import annotations

import torch

from ..layout import Layout

# -- online head typing -------------------------------------------------------------------------


def locality(weights: torch.Tensor, pos: torch.Tensor, q: torch.Tensor, layout: Layout):
    """How much a query's attention over the image favours its neighbourhood, and whether that is measurable.

    The neighbourhood is the query and the ``row_stride`` positions before it: exactly what a head
    keeping only the last row reads (the left neighbours and the token directly above). With ``s``
    the share of the query's image attention (prompt excluded) on the neighbourhood and ``u`` the
    share uniform attention over the same entries would give, the locality is
    ``(s - u) / (1 - u)``: 1 when all image attention is on the neighbourhood, 0 for uniform
    attention, negative when the head looks away from it. Raw ``s`` alone says nothing early in
    the image: in the first row every entry is in the neighbourhood.

    Parameters
    ----------
    weights : (B, H, C) float
        Attention on the slots (the prompt's share is left out).
    pos : (B, H, C) long
        The slots' sequence positions, -1 for free slots.
    q : () long
        The query's position.

    Returns
    -------
    locality : (B, H) float, 0 where not measurable.
    measurable : (B, H) bool, the head holds image entries outside the neighbourhood.
    """
    held = pos >= 0
    near = held & (q - pos <= layout.row_stride)
    image = (weights * held).sum(-1)
    s = (weights * near).sum(-1) / image.clamp_min(1e-30)
    n_near, n_held = near.sum(-1), held.sum(-1)
    measurable = n_held > n_near
    u = n_near / n_held.clamp_min(1)
    value = (s - u) / (1 - u).clamp_min(1e-30)
    return torch.where(measurable, value, torch.zeros_like(value)), measurable


def classify(total: torch.Tensor, count: torch.Tensor, threshold: float) -> torch.Tensor:
    """Local heads (True): mean locality (``total / count`` over the measurable queries) above
    ``threshold``. A head with no measurable query is broad."""
    return (count > 0) & (total > threshold * count)


def allocate(is_local: torch.Tensor, uniform: int, small: int, large: int) -> torch.Tensor:
    """Split a layer's budget ``n_kv * uniform`` between local and broad heads.

    Local heads get ``small`` each, broad heads share the rest equally, at most ``large`` each; if
    that cap binds, the local heads share what is left instead. All-local or all-broad layers
    stay uniform. Remainders go one entry each to the first heads of a group, so the capacities
    of every (sequence, layer) sum to exactly ``n_kv * uniform``. Needs
    ``small <= uniform <= large``; then every capacity lies in ``[min(small, uniform), large]``.

    Parameters
    ----------
    is_local : (..., Hkv) bool

    Returns
    -------
    (..., Hkv) long capacities.
    """
    n_kv = is_local.shape[-1]
    total = n_kv * uniform
    a = is_local.sum(-1, keepdim=True)  # (..., 1) local heads
    b = n_kv - a  # broad heads
    broad_total = torch.where(b > 0, torch.minimum(total - a * small, b * large), torch.zeros_like(b))
    local_total = total - broad_total

    def share(members: torch.Tensor, amount: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        k = members.long().cumsum(-1) - 1  # index of each head within its group
        c = count.clamp_min(1)
        return amount // c + (k < amount % c).long()

    return torch.where(is_local, share(is_local, local_total, a), share(~is_local, broad_total, b))


# -- offline offset statistics --------------------------------------------------------------------


@torch.no_grad()
def sample_prefix(gpt, cond: torch.Tensor, n: int, seed: int = 0, temperature: float = 1.0) -> torch.Tensor:
    """Decode the first ``n`` image tokens of each condition with dense attention -> (B, n) long.

    ``temperature`` 0 is greedy; otherwise plain sampling at that temperature from a generator
    seeded with ``seed`` (on the CPU, so the tokens do not depend on the device).
    """
    from ..engine.cache import DenseKVCache

    cfg = gpt.config
    device = next(gpt.parameters()).device
    cond = cond.to(device)
    B, P = cond.shape[0], cfg.cls_token_num
    g = torch.Generator().manual_seed(seed)
    cache = DenseKVCache(cfg, B, gpt.dtype, device)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float().cpu()
        if temperature == 0:
            return logits.argmax(-1)
        return torch.multinomial((logits / temperature).softmax(-1), 1, generator=g)[:, 0]

    cache.phase = "prefill"
    logits = gpt.next_logits(gpt.embed_cond(cond), torch.arange(P, device=device), cache)
    cache.pos.fill_(P)
    cache.phase = "decode"
    out = [pick(logits)]
    for _ in range(n - 1):
        h = gpt.tok_embeddings(out[-1].to(device)[:, None])  # (B, 1, dim)
        logits = gpt.next_logits(h, cache.pos.view(1), cache)
        cache.pos.add_(1)
        out.append(pick(logits))
    return torch.stack(out, dim=1).to(device)


class OffsetMassCapture:
    """Attention backend for one teacher-forced pass: causal attention, computed here so the weights
    are at hand, reduced on the fly to the mass per (layer, head, backward offset).

    Only queries at positions ``q_lo <= q < q_hi`` and keys at image positions past the sinks
    (``k >= first_key``) count: the prompt and sinks are always read by an offset policy, so their
    mass says nothing about which offsets to keep. One layer's weights live at a time.

    Attributes
    ----------
    mass : (L, H, M) float64
        Summed attention per offset 0..M-1 over the counted queries of every sequence.
    count : (M,) float64
        Number of counted (sequence, query) pairs that can reach each offset.
    """

    def __init__(self, n_layer: int, n_head: int, n_offsets: int, q_lo: int, q_hi: int, first_key: int, device):
        self.M, self.q_lo, self.q_hi, self.first_key = n_offsets, q_lo, q_hi, first_key
        self.mass = torch.zeros(n_layer, n_head, n_offsets, dtype=torch.float64, device=device)
        self.count = torch.zeros(n_offsets, dtype=torch.float64, device=device)

    def _pairs(self, T: int, device):
        qpos = torch.arange(T, device=device)[:, None]  # (T, 1)
        kpos = torch.arange(T, device=device)[None, :]  # (1, T)
        off = qpos - kpos  # (T, T)
        sel = (qpos >= self.q_lo) & (qpos < self.q_hi) & (kpos >= self.first_key) & (off >= 0) & (off < self.M)
        return off.clamp(0, self.M - 1), sel

    def attend(self, layer: int, q, k, v):
        B, H, T, D = q.shape
        G = H // k.shape[1]
        k = k.repeat_interleave(G, dim=1) if G > 1 else k  # (B, H, T, D)
        v = v.repeat_interleave(G, dim=1) if G > 1 else v
        s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * D**-0.5  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        w = s.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bhkd->bhqd", w, v.float()).to(q.dtype)
        off, sel = self._pairs(T, q.device)
        src = (w.sum(0) * sel).reshape(H, T * T).double()  # (H, T*T): summed over sequences
        self.mass[layer].scatter_add_(1, off.reshape(1, -1).expand(H, -1), src)
        if layer == 0:
            self.count.scatter_add_(0, off.reshape(-1), sel.reshape(-1).double() * B)
        return out

    def mean_mass(self) -> torch.Tensor:
        """(L, H, M) mean attention per counted query at each offset; -inf where no query reaches it."""
        return torch.where(self.count > 0, self.mass / self.count.clamp_min(1), torch.full_like(self.mass, float("-inf")))


@torch.no_grad()
def offset_mass(gpt, cond: torch.Tensor, tokens: torch.Tensor, sinks: int = 0) -> torch.Tensor:
    """Mean attention mass per (layer, head, backward offset) of the decode queries that input ``tokens``.

    ``tokens`` (B, n): the first n image tokens; the queries are the decode steps at image indices
    0..n-1 (each inputs its token and reads everything before it). Offsets 0..n-1.

    Returns
    -------
    (L, H, n) float64, -inf at offsets no query reaches (past the sinks).
    """
    cfg = gpt.config
    P, n = cfg.cls_token_num, tokens.shape[1]
    device = next(gpt.parameters()).device
    capture = OffsetMassCapture(cfg.n_layer, cfg.n_head, n, P, P + n, P + sinks, device)
    h = torch.cat([gpt.embed_cond(cond.to(device)), gpt.tok_embeddings(tokens.to(device))], dim=1)  # (B, P+n, dim)
    gpt.forward_hidden(h, torch.arange(h.shape[1], device=device), capture)
    return capture.mean_mass()


def choose_offsets(mean: torch.Tensor, local: int, window: int, count: int) -> tuple:
    """Per (layer, head): offsets 0..local-1, then the offsets below ``window`` with the largest mean
    mass, ``count`` offsets in all; ties (and unmeasured offsets, which rank last) go to the nearer offset.

    Parameters
    ----------
    mean : (L, H, M) mean mass per offset (-inf where unmeasured).

    Returns
    -------
    tuple (per layer) of tuples (per head) of ascending offset tuples.
    """
    L, H, M = mean.shape
    score = torch.full((L, H, window), float("-inf"), dtype=torch.float64)
    score[:, :, : min(M, window)] = mean[:, :, :window].double().cpu()
    score[:, :, :local] = float("inf")
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :, :count]
    chosen = order.sort(-1).values
    return tuple(tuple(tuple(int(o) for o in chosen[li, h]) for h in range(H)) for li in range(L))
