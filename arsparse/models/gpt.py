"""The LlamaGen GPT, state-dict compatible with the public checkpoints.

Submodule names follow LlamaGen (``tok_embeddings``, ``cls_embedding``, ``layers.N.attention.wqkv``,
``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) so that its
checkpoints load unchanged. Attention goes through an optional *attention backend* (the KV cache
of the engine, or a policy) so that one model definition serves training, teacher forcing,
dense decoding and sparse decoding.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layout import Layout
from ..prompt_mask import attention_mask, check_prompt_mask
from .config import GPTConfig
from .rope import apply_rope, rope_table

# GPT.fuse's default: each block's w1 and w3 as one matrix product (at batch 256 on an H200 the
# SwiGLU products 0.655 -> 0.537 ms per step, BENCHMARKS run 11; ``arsparse bench --variant w13=0``).
MERGE_FFN = True


class AttentionBackend(Protocol):
    """What the model calls for attention when it is not plain causal self-attention.

    A backend whose ``rotates_qk`` attribute is true when the fused path calls it gets q and k unrotated
    (unless the block's first half ``folds_rope``), with the step's RoPE table as ``attend(..., rope=table)``,
    and rotates them in its own kernel.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, D), k/v (B, Hkv, T, D) of the new positions -> output (B, H, T, D)."""
        ...


class MaskedAttention:
    """Attention restricted by boolean masks (True = attend), for teacher forcing.

    ``layers`` (L, H, T, T): one mask per layer (an offset policy's read sets); ``rows``
    (B, 1, T, T): one per sequence (caption padding, :func:`arsparse.prompt_mask.attention_mask`).
    Either or both; with both a key is read where both allow it.
    """

    def __init__(self, layers: torch.Tensor | None = None, rows: torch.Tensor | None = None, gqa: bool = False):
        if layers is None and rows is None:
            raise ValueError("MaskedAttention needs layers= or rows= masks")
        self.layers, self.rows, self.gqa = layers, rows, gqa

    def attend(self, layer: int, q, k, v):
        if self.layers is None:
            mask = self.rows
        else:
            mask = self.layers[layer][None] if self.rows is None else self.layers[layer][None] & self.rows
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)


# ---- the block's arithmetic as pure functions of tensors --------------------------------------
# The modules below call these; the engine may swap in compiled compositions of them (``GPT.fuse``):
# one compiled graph serves every layer, because the weights are arguments rather than attributes.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def qkv_rope(x: torch.Tensor, wqkv: torch.Tensor, rope: torch.Tensor, n_head: int, n_kv: int):
    """x (B, T, dim) -> q (B, H, T, D), k and v (B, Hkv, T, D): fused projection, then RoPE on q and k
    (``rope`` None: q and k unrotated, views of the projection, for a backend that rotates them itself)."""
    B, T, _ = x.shape
    D = wqkv.shape[0] // (n_head + 2 * n_kv)
    q, k, v = F.linear(x, wqkv).view(B, T, n_head + 2 * n_kv, D).split([n_head, n_kv, n_kv], dim=2)
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU; ``w3`` None: ``w1`` holds w1 and w3 stacked (2 * hidden, dim), one matrix product for both."""
    if w3 is None:
        gate, up = F.linear(x, w1).chunk(2, dim=-1)
    else:
        gate, up = F.linear(x, w1), F.linear(x, w3)
    return F.linear(F.silu(gate) * up, w2)


def block_in(x, f, norm_w, wqkv, rope, n_head: int, n_kv: int, eps: float):
    """First half of a block: the residual stream x + f (f: the previous block's feed-forward output,
    None for the first block), RMSNorm, QKV, RoPE -> x + f, q, k, v. Adding f here puts the
    previous block's last residual add in this RMSNorm's kernel once compiled."""
    if f is not None:
        x = x + f
    return (x, *qkv_rope(rms_norm(x, norm_w, eps), wqkv, rope, n_head, n_kv))


def block_out(x, attn, wo, norm_w, w1, w3, w2, eps: float):
    """Second half: h = x + wo(attn) -> (h, SwiGLU(RMSNorm(h))); the block's output is their sum,
    which the next block_in (or the final norm) adds. attn (B, T, H*D)."""
    h = x + F.linear(attn, wo)
    return h, swiglu(rms_norm(h, norm_w, eps), w1, w3, w2)


def final_logits(h, f, norm_w, out_w, eps: float):
    """The last block's residual add, the final RMSNorm and the output head -> fp32 logits."""
    return F.linear(rms_norm(h + f, norm_w, eps), out_w).float()


def drop_path(x: torch.Tensor, p: float) -> torch.Tensor:
    """Stochastic depth of a residual branch x (B, ...): zero it for a random ``p`` of the rows, scale the rest."""
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - p)  # (B, 1, ...)
    return x * keep.div_(1.0 - p)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LabelEmbedder(nn.Module):
    """Class label -> one condition token; row ``num_classes`` is the null class used by guidance."""

    def __init__(self, num_classes: int, dim: int, with_null: bool):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(with_null), dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, 1, dim)
        return self.embedding_table(labels).unsqueeze(1)


class CaptionMLP(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Precomputed T5 features (B, 120, 2048) -> condition tokens; a learned unconditional caption."""

    def __init__(self, caption_dim: int, dim: int, token_num: int):
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim)
        # A buffer in LlamaGen (so it is in the state dict but not trained as a parameter there).
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:  # (B, P, C) -> (B, P, dim)
        return self.cap_proj(caption)


# The dropouts below are functional (no modules, no state-dict keys) and behind ``self.training``
# checks, so that an eval-mode forward does exactly the work it did before they existed.

class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.dropout_p = cfg.ffn_dropout_p
        self.w13 = None  # (2 * hidden, dim) while merged: w1's and w3's weights are views into it

    def merge(self) -> None:
        """Store w1 and w3 as the two halves of one tensor (no extra memory), for one matrix product."""
        if not self.merged:
            self.w13 = torch.cat([self.w1.weight.data, self.w3.weight.data])
            self.w1.weight.data, self.w3.weight.data = self.w13.chunk(2)

    def unmerge(self) -> None:
        """Back to separate storage for w1 and w3."""
        if self.w13 is not None:
            self.w1.weight.data, self.w3.weight.data = (w.data.clone() for w in (self.w1.weight, self.w3.weight))
            self.w13 = None

    @property
    def merged(self) -> bool:
        """Merged, and w1/w3 still the views (a reassigned weight ends it)."""
        w13 = self.w13
        return (w13 is not None and self.w1.weight.data_ptr() == w13.data_ptr()
                and self.w3.weight.data_ptr() == w13[self.w1.weight.shape[0]:].data_ptr())

    def forward(self, x):
        out = swiglu(x, self.w1.weight, self.w3.weight, self.w2.weight)
        if self.training and self.dropout_p:
            out = F.dropout(out, self.dropout_p, training=True)
        return out


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.attn_dropout_p, self.resid_dropout_p = cfg.attn_dropout_p, cfg.resid_dropout_p

    def forward(self, x, rope, layer: int, backend: AttentionBackend | None):
        q, k, v = qkv_rope(x, self.wqkv.weight, rope, self.n_head, self.n_kv)  # (B, H|Hkv, T, D)
        out = self.wo(self.attend(q, k, v, layer, backend, self.attn_dropout_p if self.training else 0.0))
        if self.training and self.resid_dropout_p:
            out = F.dropout(out, self.resid_dropout_p, training=True)
        return out

    def attend(self, q, k, v, layer: int, backend: AttentionBackend | None, dropout_p: float = 0.0,
               rope: torch.Tensor | None = None) -> torch.Tensor:
        """-> (B, T, H*D), heads concatenated. ``dropout_p`` drops attention weights (plain causal attention only).
        ``rope``: q and k are unrotated and the backend (``rotates_qk``) rotates them by this table."""
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                                 enable_gqa=self.n_kv != self.n_head)
        elif rope is not None:
            out = backend.attend(layer, q, k, v, rope=rope)
        else:
            out = backend.attend(layer, q, k, v)
        B, _, T, _ = out.shape
        return out.transpose(1, 2).reshape(B, T, -1)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, drop_path_p: float = 0.0):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.drop_path_p = drop_path_p

    def forward(self, x, rope, layer, backend):
        p = self.drop_path_p if self.training else 0.0
        a = self.attention(self.attention_norm(x), rope, layer, backend)
        h = x + (drop_path(a, p) if p else a)
        f = self.feed_forward(self.ffn_norm(h))
        return h + (drop_path(f, p) if p else f)

    def forward_fused(self, x, f, rope, layer, backend, fused):
        """The block through ``fused`` = (block_in, block_out, ...), possibly compiled: x, f (the previous
        block's output as the pair whose sum it is; f None for the first block) -> this block's pair."""
        first, second = fused[:2]
        a, ff = self.attention, self.feed_forward
        # RoPE in the backend's kernel rather than in ``first``, unless ``first`` folds it into its product
        late = getattr(backend, "rotates_qk", False) and not getattr(first, "folds_rope", False)
        x, q, k, v = first(x, f, self.attention_norm.weight, a.wqkv.weight, None if late else rope, a.n_head,
                           a.n_kv, self.attention_norm.eps)
        w1, w3 = (ff.w13, None) if ff.merged else (ff.w1.weight, ff.w3.weight)
        return second(x, a.attend(q, k, v, layer, backend, rope=rope if late else None), a.wo.weight,
                      self.ffn_norm.weight, w1, w3, ff.w2.weight, self.ffn_norm.eps)


class GPT(nn.Module):
    """LlamaGen's GPT (c2i or t2i) with a pluggable attention backend."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        if cfg.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.has_null_class)
        else:
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # stochastic depth rising linearly from 0 at the first layer to drop_path_rate at the last
        rates = [cfg.drop_path_rate * i / max(1, cfg.n_layer - 1) for i in range(cfg.n_layer)]
        self.layers = nn.ModuleList(TransformerBlock(cfg, rates[i]) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        table = rope_table(cfg.grid_h, cfg.grid_w, cfg.head_dim, cfg.rope_base, cfg.cls_token_num)
        self.register_buffer("rope", table, persistent=False)  # (P + N, D/2, 2), fp32
        self.layout = Layout(cfg.cls_token_num, cfg.grid_h, cfg.grid_w)
        self.fused = None

    def fuse(self, compiler=None, halves=None, merge_ffn: bool | None = None) -> "GPT":
        """Run each block as two functions of tensors (``block_in``, ``block_out``), through ``compiler``.

        ``gpt.fuse(torch.compile)`` compiles each half once for all layers (the weights are arguments),
        which turns a decode step's ~50 small kernels per layer into ~10. ``gpt.fuse(None)`` runs the
        same composition uncompiled; ``gpt.unfuse()`` returns to the module path. The fused path is
        for inference: it has no dropout, in ``train()`` mode too. A third function, ``final_logits``,
        takes the last position's residual add, final norm and head (:meth:`next_logits`).
        ``halves``: other functions of the same signatures, all three (:mod:`arsparse.models.matvec_blocks`:
        steps of a few rows through Triton matrix-vector kernels).
        ``merge_ffn`` (default :data:`MERGE_FFN`; not with ``halves``): each block's w1 and w3 stored as one
        tensor and applied as one matrix product (wider tiles fill more SMs at a few hundred rows).
        """
        if halves is not None and merge_ffn:
            raise ValueError("merge_ffn applies to the built-in halves only, not to halves=...")
        wrap = compiler or (lambda fn: fn)
        self.fused = tuple(wrap(fn) for fn in (halves or (block_in, block_out, final_logits)))
        merge = halves is None and (MERGE_FFN if merge_ffn is None else merge_ffn)
        for layer in self.layers:
            if merge:
                layer.feed_forward.merge()
            else:
                layer.feed_forward.unmerge()
        return self

    def unfuse(self) -> "GPT":
        self.fused = None
        for layer in self.layers:
            layer.feed_forward.unmerge()
        return self

    # ---- conditions ----------------------------------------------------------
    def check_cond(self, cond: torch.Tensor, allow_null: bool = False) -> None:
        """Raise a clear ValueError for a condition the model cannot take.

        ``allow_null`` admits the null class (label ``num_classes``), the unconditional input.
        """
        cfg = self.config
        if cfg.model_type == "c2i":
            if cond.dtype not in (torch.int32, torch.int64) or cond.dim() != 1:
                raise ValueError(f"c2i condition must be a 1-D integer tensor of class labels, got {cond.dtype} {tuple(cond.shape)}")
            top = cfg.num_classes - 1 + int(allow_null and cfg.has_null_class)
            if cond.numel() and (int(cond.min()) < 0 or int(cond.max()) > top):
                raise ValueError(f"class labels must be in [0, {top}], got {cond.tolist()}")
        else:
            want = (cfg.cls_token_num, cfg.caption_dim)
            if cond.dim() != 3 or tuple(cond.shape[1:]) != want or not cond.is_floating_point():
                raise ValueError(f"t2i condition must be float caption features (B, {want[0]}, {want[1]}), got {cond.dtype} {tuple(cond.shape)}")

    def check_tokens(self, tokens: torch.Tensor, batch: int) -> None:
        """Raise a clear ValueError for teacher-forced tokens the model cannot take: a (batch, T) integer
        tensor with 1 <= T <= image_tokens and ids in [0, vocab_size).

        The id check waits for the device: for the entry points that take the caller's tokens
        (:meth:`logits`, :meth:`loss`, a policy's teacher forcing), never for a decode step.
        """
        cfg = self.config
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            got = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a (B, T) integer tensor, got {got}")
        B, T = tokens.shape
        if B != batch:
            raise ValueError(f"{batch} conditions for {B} token rows: give one condition per row of tokens")
        if not 1 <= T <= cfg.image_tokens:
            raise ValueError(f"tokens must have 1..{cfg.image_tokens} columns (the model's image tokens), got {T}")
        if tokens.numel():
            lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # (one wait for the device)
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) (the model's vocabulary), got "
                                 f"{lo if lo < 0 else hi} (the ids range over [{lo}, {hi}])")

    def null_cond(self, cond: torch.Tensor) -> torch.Tensor:
        """The unconditional counterpart of ``cond`` used by classifier-free guidance."""
        if self.config.model_type == "c2i":
            if not self.config.has_null_class:
                raise ValueError("this model has no null class (class_dropout_prob=0): guidance is unavailable")
            return torch.full_like(cond, self.config.num_classes)
        return self.cls_embedding.uncond_embedding.to(cond.dtype).expand_as(cond)

    def embed_cond(self, cond: torch.Tensor) -> torch.Tensor:
        """cond -> (B, P, dim) condition tokens (labels may include the null class)."""
        emb = self.cls_embedding(cond.to(self.dtype) if cond.is_floating_point() else cond)
        return emb[:, : self.config.cls_token_num]

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    # ---- forward -------------------------------------------------------------
    def _blocks(self, h: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend | None):
        """The layers -> (h, f): the residual stream and, on the fused path, the last block's
        feed-forward output still to be added to it (None on the module path)."""
        if positions.dim() == 1:
            rope = self.rope.index_select(0, positions)  # (T, D/2, 2)
        else:
            rope = self.rope[positions]  # (B, T, D/2, 2)
        if self.fused is None:
            for i, layer in enumerate(self.layers):
                h = layer(h, rope, i, backend)
            return h, None
        f = None
        for i, layer in enumerate(self.layers):
            h, f = layer.forward_fused(h, f, rope, i, backend, self.fused)
        return h, f

    def forward_hidden(self, h: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend | None = None):
        """h (B, T, dim) at sequence ``positions`` -> normalised hidden states (B, T, dim).

        ``positions`` is (T,), shared by every row, or (B, T), one row each (continuous batching,
        where sequences that joined at different steps decode side by side).
        """
        h, f = self._blocks(h, positions, backend)
        return self.norm(h if f is None else h + f)

    def next_logits(self, h: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend | None = None):
        """h (B, T, dim) at ``positions`` -> fp32 logits (B, vocab) of the token after the last position
        (a prefill's or a decode step's output): the blocks, then the final norm and the head on the
        last position only (fused: one function of them, ``final_logits`` or the halves' own)."""
        h, f = self._blocks(h, positions, backend)
        if f is None:
            return self.head(self.norm(h[:, -1]))
        return self.fused[2](h[:, -1], f[:, -1], self.norm.weight, self.output.weight, self.norm.eps)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(h).float()

    def logits(self, cond: torch.Tensor, tokens: torch.Tensor, policy=None,
               backend: AttentionBackend | None = None, prompt_mask=None) -> torch.Tensor:
        """Teacher-forced logits (B, T, vocab): position i predicts image token i from cond and tokens < i.

        With ``policy`` (a name or a policy object), attention is computed as the decode path
        computes it under that policy: masked to each query's read set for offset policies,
        token by token through the evicting cache for scored ones. ``backend`` overrides attention
        directly (used by the policies themselves; it applies any caption mask itself).
        ``prompt_mask`` (t2i): (B, P) bool, True at real caption tokens; padded prompt keys are
        read by no query but their own, as in LlamaGen (see :mod:`arsparse.prompt_mask`).
        """
        cfg = self.config
        self.check_cond(cond, allow_null=True)
        self.check_tokens(tokens, cond.shape[0])
        mask = check_prompt_mask(prompt_mask, cond.shape[0], cfg.cls_token_num, cfg.model_type)
        if policy is not None:
            from ..policies import resolve

            return resolve(policy).prepare(self).teacher_forced_logits(self, cond, tokens, prompt_mask=mask)
        h = torch.cat([self.embed_cond(cond), self.tok_embeddings(tokens[:, :-1])], dim=1)  # (B, P+T-1, dim)
        if self.training and cfg.token_dropout_p and self.fused is None:
            h = F.dropout(h, cfg.token_dropout_p, training=True)
        if mask is not None:
            if backend is not None:
                raise ValueError("give prompt_mask or backend, not both: a backend applies the caption mask itself")
            rows = attention_mask(mask.to(h.device), h.shape[1])  # (B, 1, P+T-1, P+T-1)
            backend = MaskedAttention(rows=rows, gqa=cfg.kv_heads != cfg.n_head)
        positions = torch.arange(h.shape[1], device=h.device)
        h = self.forward_hidden(h, positions, backend)
        return self.head(h[:, cfg.cls_token_num - 1 :])

    def loss(self, cond: torch.Tensor, tokens: torch.Tensor, prompt_mask=None,
             backend: AttentionBackend | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of teacher forcing: the training objective (``backend``:
        attention as it computes it, e.g. an offset policy's read sets for sparse-aware training)."""
        logits = self.logits(cond, tokens, prompt_mask=prompt_mask, backend=backend)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
