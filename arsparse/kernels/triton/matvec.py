"""Launch wrapper of the small-batch projection kernel: checks, block sizes.

``matvec`` computes ``y = op(x) @ w.T`` for at most :data:`MAX_ROWS` rows with the ops around a
transformer block's projections folded in (RMSNorm, the residual adds, SwiGLU's gate, RoPE); see
``_matvec.py``. :mod:`arsparse.models.matvec_blocks` composes the block's two halves from it.
"""
from __future__ import annotations

import torch
import triton

from ._matvec import matvec_kernel
from .decode import check_rope_table
from ._pdl import pdl_args
from .settings import json_settings

#: Rows one launch takes (each weight tile is multiplied into every row in registers).
MAX_ROWS = 16
#: Launch settings: weight rows per program, the reduction's chunk (cut so that the (rows, block_n,
#: block_k) product tile holds at most max_tile elements), warps, stages. The fastest over a block's
#: four projections at 2 rows on the H200 (docs/bench/matvec-sweep.sh, BENCHMARKS run 8): 30.4 us
#: per block against 43.2 for the first guess (8 rows, chunks of 512) and 81.6 for cuBLAS + PyTorch.
#: ``weights_first``: 1 makes a launch whose rows fit one chunk ask for its weight tile before it
#: reads (and normalises) the input, and read the input once (more registers): run 9 at batch 1, dense
#: step 1.457 against 1.473 ms, diagonal 1.336 against 1.355. (Prefetching the next launches' weights
#: into the L2 was slower, 1.495 / 1.371, and was removed. Fewer warps, run 29 on an H100, dense / diagonal
#: at batch 1: 2 warps 1.218 / 1.113 against 1.166 / 1.042; with 2 weight rows 1.326 / 1.188.)
LAUNCH = dict(block_n=4, block_k=4096, max_tile=32768, num_warps=4, num_stages=2, weights_first=1)


def parse_launch(text: str) -> dict:
    """``'{"block_n": 16, "num_warps": 8}'`` -> :data:`LAUNCH` with those settings (positive ints,
    block sizes powers of 2). For ``arsparse bench --matvec-launch``."""
    given = json_settings(text, LAUNCH, "matvec launch")
    for k, v in given.items():
        if k == "weights_first":
            if v not in (0, 1):
                raise ValueError(f"matvec launch setting {k}={v!r} must be 0 or 1")
            continue
        pow2 = k in ("block_n", "block_k", "max_tile", "num_warps")
        if type(v) is not int or v < 1 or (pow2 and v & (v - 1)) or (k == "block_n" and v < 2):
            raise ValueError(f"matvec launch setting {k}={v!r} must be a positive int"
                             f"{' and a power of 2' if pow2 else ''}{' >= 2' if k == 'block_n' else ''}")
    return dict(LAUNCH, **given)


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {dtype} {shape} on {device} with a unit last stride, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def matvec(x: torch.Tensor, w: torch.Tensor, *, add: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None, w_up: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, rope: tuple[torch.Tensor, int, int] | None = None,
           launch: dict | None = None):
    """``y = op(x) @ w.T`` for a few rows, in one kernel.

    Parameters
    ----------
    x : (M, K), M <= MAX_ROWS, unit last stride
    w : (N, K) weight (as ``nn.Linear`` holds it), x's dtype and device
    add : optional (M, K): the input is ``x + add`` (returned too, as the second value)
    norm : optional (weight (K,), eps): RMSNorm of the input first, as ``gpt.rms_norm``
    w_up : optional (N, K): SwiGLU, ``y = silu(in @ w.T) * (in @ w_up.T)``
    residual : optional (M, N): ``y = residual + in @ w.T``
    rope : optional (table (M or 1, D/2, 2) fp32 cos/sin, rotate_cols, head_dim): columns below
        ``rotate_cols`` rotated in interleaved pairs within heads of ``head_dim``, as ``apply_rope``
    launch : overrides of :data:`LAUNCH`

    Returns (M, N) in x's dtype, and with ``add`` also ``x + add`` (M, K).
    """
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be (M, K) with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}")
    M, K = x.shape
    if x.stride(-1) != 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32 with a unit last stride, got {x.dtype}")
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"w must be (N, K={K}), got {tuple(w.shape)}")
    N = w.shape[0]
    _check("w", w, (N, K), x.dtype, x.device)
    if add is not None:
        _check("add", add, (M, K), x.dtype, x.device)
    if w_up is not None:
        _check("w_up", w_up, (N, K), x.dtype, x.device)
    if residual is not None:
        _check("residual", residual, (M, N), x.dtype, x.device)
    if norm is not None:
        _check("the norm weight", norm[0], (K,), x.dtype, x.device)
    unknown = set(launch or {}) - set(LAUNCH)
    if unknown:
        raise ValueError(f"unknown matvec launch settings {sorted(unknown)}; allowed: {sorted(LAUNCH)}")
    cfg = dict(LAUNCH, **(launch or {}))
    bn = cfg.pop("block_n")
    weights_first = bool(cfg.pop("weights_first"))
    if rope is not None:
        table, rope_hi, head_dim = rope
        check_rope_table(table, M, head_dim, x.device)
        if bn % 2:
            raise ValueError(f"RoPE needs an even block_n (pairs never straddle a block), got {bn}")
        srope = 0 if table.shape[0] == 1 else table.stride(0)
    else:
        table, rope_hi, head_dim, srope = x, 0, 2, 0
    bm = triton.next_power_of_2(M)
    bk = max(16, min(cfg.pop("block_k"), triton.next_power_of_2(K), cfg.pop("max_tile") // (bm * bn)))
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    xs = torch.empty_like(x) if add is not None else x
    dummy = x  # (pointers of absent operands: never read)
    norm_w, eps = norm if norm is not None else (dummy, 0.0)
    grid = triton.cdiv(N, bn)
    matvec_kernel[(grid,)](
        x, add if add is not None else dummy, norm_w, w, w_up if w_up is not None else w,
        residual if residual is not None else dummy, table, y, xs,
        M, N, K, x.stride(0), add.stride(0) if add is not None else 0, w.stride(0),
        (w_up if w_up is not None else w).stride(0), residual.stride(0) if residual is not None else 0, srope,
        y.stride(0), xs.stride(0), float(eps), rope_hi, head_dim,
        HAS_F=add is not None, HAS_NORM=norm is not None, GLU=w_up is not None, HAS_RES=residual is not None,
        HAS_ROPE=rope is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ONE_CHUNK=weights_first and bk >= K,
        **pdl_args(x.device), **cfg)
    return (y, xs) if add is not None else y
