"""The small-batch projection kernel and the block halves built on it, against the PyTorch
composition of ``arsparse.models.gpt``, on the CPU through the Triton interpreter."""
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse.kernels.triton.matvec import MAX_ROWS, matvec  # noqa: E402
from arsparse.models.gpt import apply_rope, rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("M,K,N,dtype,launch", [
    (2, 96, 80, torch.float32, None),  # a part block of columns and of the reduction
    (2, 96, 80, torch.float32, dict(weights_first=1)),  # the row in one chunk, weights loaded first
    (1, 300, 33, torch.float32, dict(block_n=32, block_k=512, weights_first=1)),  # one row; K, N off the blocks
    (16, 64, 48, torch.bfloat16, dict(weights_first=1)),  # the most rows
    (5, 200, 40, torch.bfloat16, dict(block_n=16, block_k=32)),
])
def test_matvec_ops_match_the_torch_composition(poisoned_empty, M, K, N, dtype, launch):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    x, f, w, w3, res, nw = r(M, K), r(M, K), r(N, K) / K**0.5, r(N, K) / K**0.5, r(M, N), 1 + 0.1 * r(K)
    tol = _tol(dtype)
    torch.testing.assert_close(matvec(x, w, launch=launch), F.linear(x, w), **tol)
    y, xs = matvec(x, w, add=f, norm=(nw, 1e-5), launch=launch)  # block_in's first half
    exact = dict(atol=0, rtol=0 if dtype == torch.float32 else 1e-2)  # (the interpreter rounds bf16 casts its own way)
    torch.testing.assert_close(xs, x + f, **exact)
    torch.testing.assert_close(y, F.linear(rms_norm(x + f, nw, 1e-5), w), **tol)
    got = matvec(x, w, norm=(nw, 1e-6), w_up=w3, launch=launch)  # SwiGLU's gate and up projections
    want = F.silu(F.linear(rms_norm(x, nw, 1e-6), w)) * F.linear(rms_norm(x, nw, 1e-6), w3)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(matvec(x, w, residual=res, launch=launch), res + F.linear(x, w), **tol)
    if launch and launch.get("weights_first"):  # the same sums in the same order as the chunk loop's one pass
        loop = dict(launch, weights_first=0)
        assert torch.equal(matvec(x, w, add=f, norm=(nw, 1e-5), launch=loop)[0], y)
        assert torch.equal(matvec(x, w, norm=(nw, 1e-6), w_up=w3, launch=loop), got)


@pytest.mark.parametrize("block_n", [32, 2])
@pytest.mark.parametrize("rows_table", [False, True], ids=["shared-position", "position-per-row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_rope_rotates_q_and_k_columns_only(poisoned_empty, rows_table, dtype, block_n):
    """A fused wqkv output (H + 2 Hkv heads of D): q and k heads rotated as apply_rope, v untouched."""
    M, K, H, Hkv, D = 3, 64, 4, 2, 16
    g = torch.Generator().manual_seed(7 + rows_table)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn((H + 2 * Hkv) * D, K, generator=g) / K**0.5).to(DEVICE, dtype)
    angle = torch.rand(M if rows_table else 1, D // 2, generator=g) * 6.3
    table = torch.stack([angle.cos(), angle.sin()], -1).to(DEVICE)  # (M or 1, D/2, 2)
    got = matvec(x, w, rope=(table, (H + Hkv) * D, D), launch=dict(block_n=block_n, block_k=4096))
    lin = F.linear(x, w)
    q, k, v = lin.split([H * D, Hkv * D, Hkv * D], dim=-1)
    t = table[:, None] if rows_table else table  # apply_rope: (T, D/2, 2) or (B, T, D/2, 2)
    want = torch.cat([apply_rope(q.view(M, 1, H, D), t).reshape(M, -1), apply_rope(k.view(M, 1, Hkv, D), t).reshape(M, -1),
                      v], dim=-1)
    torch.testing.assert_close(got, want, **_tol(dtype))
    plain = matvec(x, w, launch=dict(block_n=block_n, block_k=4096))  # v's columns: the same kernel's product
    torch.testing.assert_close(got[:, (H + Hkv) * D:], plain[:, (H + Hkv) * D:], atol=0, rtol=0)


def test_matvec_launch_settings_parse_and_reject_bad_ones():
    from arsparse.kernels.triton import matvec as mv

    assert mv.parse_launch('{"block_n": 16, "num_warps": 8}') == dict(mv.LAUNCH, block_n=16, num_warps=8)
    assert mv.parse_launch('{"weights_first": 0}')["weights_first"] == 0
    for text, msg in (("block_n=16", "must be a JSON object"), ('{"rows": 2}', "keys from"),
                      ('{"weights_first": 2}', "weights_first=2 must be 0 or 1"),
                      ('{"block_k": 300}', "power of 2"), ('{"block_n": 1}', ">= 2"), ('{"num_stages": 0}', "positive")):
        with pytest.raises(ValueError, match=msg):
            mv.parse_launch(text)


def test_matvec_rejects_bad_input():
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match=f"1 <= M <= {MAX_ROWS}"):
        matvec(torch.randn(MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError, match=r"w must be \(N, K=32\)"):
        matvec(x, torch.randn(16, 31))
    with pytest.raises(ValueError, match="residual must be"):
        matvec(x, w, residual=torch.randn(2, 15))
    with pytest.raises(ValueError, match="w_up must be"):
        matvec(x, w, w_up=w.half())
    with pytest.raises(ValueError, match=r"unknown matvec launch settings \['rows'\]"):
        matvec(x, w, launch=dict(rows=2))
    with pytest.raises(ValueError, match="the rope table must be"):
        matvec(x, w, rope=(torch.randn(2, 3, 2), 16, 8))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU generations through the interpreter (on a GPU: tests/test_cuda.py)")
@pytest.mark.parametrize("model_type,policy", [("c2i", None), ("t2i", "diagonal:local=3,rows=1,band=1,sinks=1")],
                         ids=["c2i-dense", "t2i-diagonal"])
def test_generator_with_matvec_blocks_matches_the_torch_blocks(model_type, policy):
    """The whole decode loop (guidance: 2 rows per image, 3 images) through the matvec halves gives
    the PyTorch halves' tokens, with every decode step's four projections and its head in the kernel
    (a caption prefill of several positions takes the PyTorch halves, then the kernel's head)."""
    from arsparse import Generator
    from arsparse.models import matvec_blocks
    from conftest import random_cond, random_gpt

    model = random_gpt(model_type, seed=5)
    cond = random_cond(model, 3)
    kw = dict(cfg_scale=2.0, temperature=1.0, seed=3)
    make = lambda **m: Generator(model, device="cpu", dtype="fp32", kernel="torch", policy=policy, **m)  # noqa: E731
    want = make().sample_tokens(cond, **kw)
    calls = []
    real = matvec_blocks.matvec

    def counting(*a, **k):
        calls.append(a[0].shape[0])  # rows
        return real(*a, **k)

    matvec_blocks.matvec = counting
    try:
        got = make(matvec=True).sample_tokens(cond, **kw)
    finally:
        matvec_blocks.matvec = real
    cfg = model.config  # 4 per block at every decode step and a prefill of one position (a class token),
    steps = cfg.image_tokens - 1 + (cfg.cls_token_num == 1)  # and the final norm + head after every pass
    assert calls == [6] * (steps * cfg.n_layer * 4 + cfg.image_tokens)
    assert torch.equal(got, want)


def test_matvec_generator_rejects_compile_and_the_plain_cpu(monkeypatch):
    from arsparse import Generator
    from conftest import random_gpt

    with pytest.raises(ValueError, match="matvec=True takes neither compile"):
        Generator(random_gpt(), device="cpu", matvec=True, compile=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="device Triton cannot run on"):
        Generator(random_gpt(), device="cpu", matvec=True)


def test_matvec_kernel_compiles_for_hopper():
    """Each fused form the block halves launch, built for sm_90 (see conftest.compile_for_hopper)."""
    from conftest import compile_for_hopper
    from test_kernels import PDL_PTX

    flags = dict(HAS_F=False, HAS_NORM=False, GLU=False, HAS_RES=False, HAS_ROPE=False, BLOCK_M=2, BLOCK_N=4,
                 BLOCK_K=2048, ONE_CHUNK=True)
    builds = {"wqkv": (dict(flags, HAS_F=True, HAS_NORM=True, HAS_ROPE=True), 4),
              "w1-w3": (dict(flags, HAS_NORM=True, GLU=True), 4),
              "wo": (dict(flags, HAS_RES=True), 4),
              "w2-16-rows": (dict(flags, BLOCK_M=16, BLOCK_K=64, ONE_CHUNK=False), 2),
              "w1-w3-chunks": (dict(flags, HAS_F=True, HAS_NORM=True, GLU=True, BLOCK_K=512, ONE_CHUNK=False), 4),
              "wqkv-pdl": (dict(flags, HAS_NORM=True, HAS_ROPE=True, PDL=True), 4, PDL_PTX),
              "w2-16-rows-residual-pdl": (dict(flags, HAS_RES=True, BLOCK_M=16, BLOCK_K=64, ONE_CHUNK=False, PDL=True), 2,
                                          PDL_PTX)}
    pointers = dict(ROPE="*fp32", **{n: "*bf16" for n in ("X", "F", "NW", "W", "W3", "RES", "Y", "XS")})
    compile_for_hopper("arsparse.kernels.triton._matvec", "matvec_kernel", pointers, builds)


@pytest.mark.parametrize("N,K,cfg", [(37, 256, dict(block_n=4, tiles=2, stages=3)), (64, 384, dict(block_n=8, tiles=1, stages=4)),
                                     (5, 128, dict(block_n=2, tiles=4, stages=8))])
def test_the_tma_experiment_kernel_matches_f_linear(N, K, cfg):
    """docs/bench/matvec_tma.py's kernel (run 30's experiment): x @ W.T through TMA boxes, blocks past N unwritten."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "bench" / "matvec_tma.py"
    spec = importlib.util.spec_from_file_location("matvec_tma", path)
    tma = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tma)
    g = torch.Generator().manual_seed(N * K)
    x, w = torch.randn(3, K, generator=g).to(DEVICE), (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE)
    torch.testing.assert_close(tma.tma_matvec(x, w, **cfg), F.linear(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="multiple of 128"):
        tma.tma_matvec(x[:, :100], w[:, :100], **cfg)


@pytest.mark.parametrize("M,dim,NH,block_r,block_k,by_cols", [(2, 96, 80, 16, 32, 1), (3, 64, 40, 8, 64, 0),
                                                             (1, 48, 24, 32, 16, 1)])
def test_the_fused_ffn_experiment_kernel_matches_swiglu(M, dim, NH, block_r, block_k, by_cols):
    """docs/bench/ffn_fused.py's kernel (run 32's experiment): RMSNorm + SwiGLU in one launch, w2's reduction
    split over the programs and added with atomics; the second buffer zeroed; hidden units and columns off the blocks."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "bench" / "ffn_fused.py"
    spec = importlib.util.spec_from_file_location("ffn_fused", path)
    exp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp)
    g = torch.Generator().manual_seed(M * dim + NH)
    h = torch.randn(M, dim, generator=g).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE)
    w1, w3 = ((torch.randn(NH, dim, generator=g) / dim**0.5).to(DEVICE) for _ in range(2))
    w2 = (torch.randn(dim, NH, generator=g) / NH**0.5).to(DEVICE)
    acc, other = torch.zeros(M, dim, device=DEVICE), torch.full((M, 2 * dim), float("nan"), device=DEVICE)
    got = exp.ffn(h, nw, 1e-5, w1, w3, w2.t().contiguous().t() if by_cols else w2, acc, zero=other,
                  block_r=block_r, block_k=block_k)
    want = F.linear(F.silu(F.linear(rms_norm(h, nw, 1e-5), w1)) * F.linear(rms_norm(h, nw, 1e-5), w3), w2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert bool((other == 0).all())
    with pytest.raises(ValueError, match="shapes"):
        exp.ffn(h, nw, 1e-5, w1, w3, w2.t(), acc)
