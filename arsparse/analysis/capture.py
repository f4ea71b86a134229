"""Record attention while the model runs: a context manager whose hooks always remove themselves.

:class:`AttentionCapture` puts a forward pre-hook on the attention module of every selected layer.
The hook wraps the attention backend the layer is called with in a *tap*, which lets the model
compute its output exactly as it would have (plain causal SDPA, or the backend's own ``attend``)
and, next to it, computes the attention weights of the selected heads from the same ``q`` and
keys, in small chunks of queries, and hands them to an
:class:`~arsparse.analysis.metrics.AttentionStats` (and/or a callback):

* **teacher-forced passes** (``gpt.logits(cond, tokens)``, ``gpt.forward_hidden(..., backend=None)``):
  the keys are the pass's own ``k``, the queries its positions 0..T-1 (the pass must start at
  position 0);
* **the dense KV cache** of the engine (``DenseKVCache``: ``phase``, ``pos``, ``k``): in the
  ``"prefill"`` phase as above; in the ``"decode"`` phase the query is at ``cache.pos`` and the keys
  are the cache's ``k[layer][:, :, :pos + 1]`` right after the backend wrote the new key, i.e.
  exactly what the decode step attends over.

Other backends (sparse policies' caches, masked attention) are refused: their attention is not
the dense one. Batch rows are assigned to named *phases* with :meth:`AttentionCapture.phase`;
outside a phase the taps pass through without recording. CUDA graphs and ``torch.compile`` bypass
Python hooks, so a Generator used under capture must have both off (:func:`capture_decode` checks).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from .metrics import AttentionStats

__all__ = ["AttentionCapture", "attention_weights", "capture_decode", "capture_teacher_forced"]


def attention_weights(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention weights in fp32.

    Parameters
    ----------
    q : (B, H, Tq, D) queries at sequence positions ``qpos`` (Tq,).
    k : (B, H, S, D) keys at positions 0..S-1.

    Returns
    -------
    (B, H, Tq, S) float32, zero on keys after the query.
    """
    D = q.shape[-1]
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * D**-0.5  # (B, H, Tq, S)
    after = torch.arange(k.shape[2], device=q.device)[None, :] > qpos.to(q.device)[:, None]  # (Tq, S)
    return s.masked_fill(after, float("-inf")).softmax(-1)


def _is_dense_cache(backend) -> bool:
    from ..engine.cache import DenseKVCache

    return isinstance(backend, DenseKVCache)


class _Tap:
    """The backend a hooked layer sees: delegates, and records the weights of the same q and keys."""

    def __init__(self, inner, capture: "AttentionCapture"):
        self.inner, self.capture = inner, capture

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        inner, cap = self.inner, self.capture
        if inner is None:  # exactly the model's own line for backend=None
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
            if cap.recording:
                cap._record_parallel(layer, q, k)
            return out
        if not _is_dense_cache(inner):
            raise TypeError(f"attention capture supports plain causal attention and the dense KV cache, not "
                            f"{type(inner).__name__} (sparse policies do not compute dense attention)")
        out = inner.attend(layer, q, k, v)
        if cap.recording:
            if inner.phase == "prefill":
                cap._record_parallel(layer, q, k)
            else:
                pos = int(inner.pos)
                cap._record_decode(layer, q, inner.k[layer][:, :, : pos + 1], pos)
        return out


class AttentionCapture:
    """Context manager that records the attention of chosen layers, heads and queries.

    Parameters
    ----------
    gpt : GPT
        The model; only forward pre-hooks are added (and removed on exit, exceptions included).
    stats : AttentionStats, optional
        Receives every recorded chunk (``stats.add(phase, layer, qpos, w)``); its ``layers`` and
        ``heads`` are the capture's defaults.
    layers, heads : sequence of int, optional
        What to record (default: those of ``stats``, else all).
    steps : iterable of int, optional
        Image indices ``i`` of the queries to record: the query at sequence position ``P + i``,
        which inputs image token ``i`` (in decoding, the step that samples token ``i + 1``);
        ``0 .. N - 2``. Default all. Prompt queries are never recorded.
    callback : callable, optional
        ``callback(phase, layer, qpos, w)`` with ``w`` (B_phase, Hs, Tq, S), for every chunk.
    chunk_elems : int
        Upper bound on the elements of one chunk of weights (B x Hs x Tq x S).

    Examples
    --------
    >>> with AttentionCapture(gpt, stats) as cap, cap.phase("prefill"):   # doctest: +SKIP
    ...     gpt.logits(cond, tokens)
    """

    def __init__(self, gpt, stats: AttentionStats | None = None, layers=None, heads=None,
                 steps: Iterable[int] | None = None, callback: Callable | None = None, chunk_elems: int = 1 << 22):
        self.gpt, self.stats, self.callback = gpt, stats, callback
        cfg = gpt.config
        self.P, self.N = cfg.cls_token_num, cfg.image_tokens
        dl = stats.layers if stats is not None else range(cfg.n_layer)
        dh = stats.heads if stats is not None else range(cfg.n_head)
        self.layers = [int(x) for x in (dl if layers is None else layers)]
        self.heads = [int(x) for x in (dh if heads is None else heads)]
        if stats is not None and (self.heads != list(stats.heads) or not set(self.layers) <= set(stats.layers)):
            raise ValueError("capture heads must equal the stats' heads and its layers be among the stats' layers")
        for x in self.layers:
            if not 0 <= x < cfg.n_layer:
                raise ValueError(f"layer {x} out of range 0..{cfg.n_layer - 1}")
        for x in self.heads:
            if not 0 <= x < cfg.n_head:
                raise ValueError(f"head {x} out of range 0..{cfg.n_head - 1}")
        self.group = cfg.n_head // cfg.kv_heads
        sel = torch.zeros(self.P + self.N, dtype=torch.bool)
        if steps is None:
            sel[self.P : self.P + self.N - 1] = True
        else:
            for i in steps:
                if not 0 <= int(i) <= self.N - 2:
                    raise ValueError(f"step {i} out of range 0..{self.N - 2} (image index of the query token)")
                sel[self.P + int(i)] = True
        self.selected = sel
        self.chunk_elems = chunk_elems
        self.rows: dict[str, slice] | None = None
        self._handles: list = []
        # decode steps not yet handed on, per layer: positions and a preallocated (B, Hs, n, T) weight buffer
        # (reused, so that thousands of small long-lived tensors do not fragment the heap)
        self._buf: dict[int, list[int]] = {}
        self._bufw: dict[int, torch.Tensor] = {}

    # -- hooks --------------------------------------------------------------------------------
    def __enter__(self) -> "AttentionCapture":
        if self._handles:
            raise RuntimeError("this AttentionCapture is already active")
        try:
            for li in self.layers:
                module = self.gpt.layers[li].attention
                self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._remove()
        return False

    def _remove(self) -> None:
        try:
            while self._handles:
                self._handles.pop().remove()
        finally:
            self.rows = None
            self._buf.clear()
            self._bufw.clear()

    def _pre_hook(self, module, args, kwargs):
        # Attention.forward(x, rope, layer, backend)
        if "backend" in kwargs:
            kwargs = dict(kwargs, backend=_Tap(kwargs["backend"], self))
        elif len(args) >= 4:
            args = (*args[:3], _Tap(args[3], self), *args[4:])
        else:
            kwargs = dict(kwargs, backend=_Tap(None, self))
        return args, kwargs

    @property
    def active(self) -> bool:
        return bool(self._handles)

    @property
    def recording(self) -> bool:
        return self.rows is not None

    @contextlib.contextmanager
    def phase(self, rows):
        """Record what runs inside under phase names: ``"name"`` (all rows) or ``{"name": slice}``."""
        if not self.active:
            raise RuntimeError("enter the AttentionCapture before starting a phase")
        prev = self.rows
        self.flush()
        self.rows = {rows: slice(None)} if isinstance(rows, str) else dict(rows)
        try:
            yield self
            self.flush()
        finally:
            self._buf.clear()  # after an error: drop what was not handed on
            self._bufw.clear()
            self.rows = prev

    # -- recording ----------------------------------------------------------------------------------
    def _select(self, q: torch.Tensor, k: torch.Tensor):
        """Selected heads of q (B, H, T, D) and their keys from k (B, Hkv, S, D)."""
        hs = torch.tensor(self.heads, device=q.device)
        return q.index_select(1, hs), k.index_select(1, torch.div(hs, self.group, rounding_mode="floor"))

    def _emit(self, layer: int, qpos: torch.Tensor, w: torch.Tensor) -> None:
        for name, rows in self.rows.items():
            part = w[rows]
            if part.shape[0] == 0:
                continue
            if self.stats is not None:
                self.stats.add(name, layer, qpos, part)
            if self.callback is not None:
                self.callback(name, layer, qpos, part)

    def _record_parallel(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        T = q.shape[2]
        qs, ks = self._select(q, k)
        pos = self.selected[:T].nonzero()[:, 0]
        if pos.numel() == 0:
            return
        B, Hs = qs.shape[0], qs.shape[1]
        start = 0
        while start < pos.numel():
            n = max(1, self.chunk_elems // max(1, B * Hs * T))
            chunk = pos[start : start + n]
            S = int(chunk[-1]) + 1
            qpos = chunk.to(q.device)
            w = attention_weights(qs.index_select(2, qpos), ks[:, :, :S], qpos)
            self._emit(layer, qpos, w)
            start += n

    def _record_decode(self, layer: int, q: torch.Tensor, keys: torch.Tensor, pos: int) -> None:
        """One decode step: weights now, handed on in chunks of steps (fewer, larger reductions)."""
        if pos >= self.selected.numel() or not bool(self.selected[pos]):
            return
        qs, ks = self._select(q, keys)
        w = attention_weights(qs, ks, torch.tensor([pos], device=q.device))  # (B, Hs, 1, pos + 1)
        B, Hs, T = w.shape[0], w.shape[1], self.P + self.N - 1
        bufw = self._bufw.get(layer)
        if bufw is None or bufw.shape[:2] != (B, Hs) or bufw.device != w.device:
            self._flush_layer(layer)
            n = max(1, self.chunk_elems // (B * Hs * T))
            bufw = self._bufw[layer] = torch.zeros(B, Hs, n, T, device=w.device)
        steps = self._buf.setdefault(layer, [])
        i = len(steps)
        bufw[:, :, i, : pos + 1] = w[:, :, 0]
        bufw[:, :, i, pos + 1 :] = 0.0
        steps.append(pos)
        if len(steps) == bufw.shape[2]:
            self._flush_layer(layer)

    def _flush_layer(self, layer: int) -> None:
        steps = self._buf.pop(layer, [])
        if not steps:
            return
        S = max(steps) + 1
        w = self._bufw[layer][:, :, : len(steps), :S]  # (B, Hs, n, S), zero after each query
        self._emit(layer, torch.tensor(steps, device=w.device), w)

    def flush(self) -> None:
        """Hand on the buffered decode steps (done when a phase ends)."""
        for layer in sorted(self._buf):
            self._flush_layer(layer)


@torch.no_grad()
def capture_teacher_forced(gpt, capture: AttentionCapture, cond: torch.Tensor, tokens: torch.Tensor,
                           phase: str = "prefill") -> torch.Tensor:
    """One teacher-forced pass ``gpt.logits(cond, tokens)`` recorded as ``phase``; returns the logits."""
    device = next(gpt.parameters()).device
    with capture.phase(phase):
        return gpt.logits(cond.to(device), tokens.to(device))


@torch.no_grad()
def capture_decode(gen, capture: AttentionCapture, cond, phase: str = "decode", uncond_phase: str | None = "decode-uncond",
                   progress: bool = False, **sampling) -> torch.Tensor:
    """Sample with ``gen.sample_tokens(cond, **sampling)`` (the engine's cached path, dense cache),
    recording the conditional rows as ``phase`` and, with guidance, the unconditional rows as
    ``uncond_phase`` (None: not recorded). Returns the (B, N) tokens.
    """
    if gen.cuda_graphs or gen.compile:
        raise ValueError("attention capture needs a Generator with cuda_graphs=False and compile=False "
                         "(graph replays and compiled steps bypass the Python hooks)")
    if getattr(gen, "policy", None) is not None:
        raise ValueError("attention capture measures dense attention: use a Generator without a policy")
    B = len(gen.as_cond(cond))
    scale = sampling.get("cfg_scale", 4.0)
    guided = any(float(s) != 1.0 for s in (scale if isinstance(scale, (list, tuple)) else [scale]))
    rows = {phase: slice(0, B)}
    if guided and uncond_phase:
        rows[uncond_phase] = slice(B, 2 * B)
    with capture.phase(rows):
        return gen.sample_tokens(cond, progress=progress, **sampling)
