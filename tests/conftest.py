import json
import os
import subprocess
import sys

import pytest
import torch

from arsparse.models.config import gpt_config
from arsparse.models.gpt import GPT


def _interpreter_dot_takes_bf16_as_numbers() -> None:
    """Triton's interpreter (3.6-3.9) multiplies bf16 dot operands as the integers that hold their bits
    (numpy has no bf16): convert them to fp32 first, as the tensor cores read them. Kernels with
    ``tl.dot`` on bf16 tiles (the dense split kernel's ``decode.LAUNCH["dot"]`` path) are then checked in bf16 on
    the CPU."""
    if "triton.language" not in sys.modules:  # (imported first here, before a test module sets
        return  # TRITON_INTERPRET, triton's own jit functions would not run in the interpreter)
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_dot, "_bf16_fixed", False):
        return
    plain = builder.create_dot

    def create_dot(self, a, b, d, *args, **kw):
        def f32(x):
            if x.dtype.scalar == tl.bfloat16 and x.data.dtype == np.uint16:
                return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return x
        return plain(self, f32(a), f32(b), d, *args, **kw)

    create_dot._bf16_fixed = True
    builder.create_dot = create_dot


@pytest.fixture(autouse=True, scope="session")
def _bf16_dot_in_the_interpreter():
    _interpreter_dot_takes_bf16_as_numbers()  # (after collection: the test modules have imported triton)


def random_gpt(model_type="c2i", image_tokens=16, seed=0, **kw) -> GPT:
    """A tiny GPT with fresh random weights large enough to give peaked, position-dependent logits."""
    torch.manual_seed(seed)
    extra = dict(vocab_size=48, num_classes=7) if model_type == "c2i" else dict(vocab_size=48, cls_token_num=5, caption_dim=12)
    extra.update(kw)
    cfg = gpt_config("GPT-tiny", image_tokens=image_tokens, model_type=model_type, **extra)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25)
    return model.eval()


def random_cond(model: GPT, batch: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if cfg.model_type == "c2i":
        return torch.randint(0, cfg.num_classes, (batch,), generator=g)
    return torch.randn(batch, cfg.cls_token_num, cfg.caption_dim, generator=g)


def random_slot_tables(B, H, Hkv, P, C, D, dtype, seed, device="cpu"):
    """Inputs of slot-table decode attention and the PyTorch reference's answer.

    Fresh random q, prompt and slot tables, about 40% of the slots free and every slot of row 0,
    kv head 0 free; free slots' K/V are NaN, so reading one poisons the result. Returns the inputs
    (q, prompt_k, prompt_v, slot_k, slot_v, slot_pos) on ``device`` and the reference (out (B, H, D),
    the slots' weights summed over each group (B, Hkv, C)), computed on the CPU before the poisoning.
    """
    from arsparse.kernels.reference import slot_decode_attention_ref

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, pk, pv, k, v = rnd(B, H, D), rnd(B, Hkv, P, D), rnd(B, Hkv, P, D), rnd(B, Hkv, C, D), rnd(B, Hkv, C, D)
    spos = torch.randint(0, 4 * C, (B, Hkv, C), generator=g)
    spos[torch.rand(B, Hkv, C, generator=g) < 0.4] = -1
    spos[0, 0] = -1
    ref = slot_decode_attention_ref(q, pk, pv, k, v, spos)
    free = (spos < 0)[..., None]
    k, v = k.masked_fill(free, float("nan")), v.masked_fill(free, float("nan"))
    return [t.to(device) for t in (q, pk, pv, k, v, spos)], ref


def row_positions(g, B: int, lo: int, hi: int, must: list[int]) -> torch.Tensor:
    """(B,) random positions in [lo, hi], the first ones set to ``must``."""
    pos = torch.randint(lo, hi + 1, (B,), generator=g)
    pos[: len(must)] = torch.tensor(must[:B])
    return pos


def random_span(g, B: int, P: int) -> torch.Tensor:
    """(B, 2) int32 spans of left, right and two-sided padding (row 0: one real token at the end)."""
    lo = torch.randint(0, P, (B,), generator=g)
    hi = lo + 1 + (torch.rand(B, generator=g) * (P - lo)).long().clamp(max=P - lo - 1)
    lo[0], hi[0] = P - 1, P
    return torch.stack([lo, hi], 1).int()


def random_decode_case(B, H, Hkv, S, D, pos, dtype, seed, device="cpu"):
    """Inputs of fused dense decode attention and the reference's answer.

    ``pos``: an int (every row there) or ``"rows"`` (random per row, among them 0, 128 % S, S - 1).
    Each row's cache entries from its position on are NaN: the slot being written and everything
    past it must never be read. Returns the inputs (q, k_new, v_new, k_cache, v_cache, pos) on
    ``device`` and the reference's (out, k_cache, v_cache after the write), computed on the CPU.
    """
    from arsparse.kernels.reference import decode_attention_ref

    g = torch.Generator().manual_seed(seed)
    q, k_new, v_new = (torch.randn(B, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    p = row_positions(g, B, 0, S - 1, [0, 128 % S, S - 1]) if pos == "rows" else torch.tensor(pos)
    for b, pb in enumerate(p.expand(B).tolist()):
        kc[b, :, pb:] = float("nan")
        vc[b, :, pb:] = float("nan")
    want_k, want_v = kc.clone(), vc.clone()
    want = decode_attention_ref(q, k_new, v_new, want_k, want_v, p)
    return [t.to(device) for t in (q, k_new, v_new, kc, vc, p)], (want, want_k, want_v)


def random_offsets(g, H: int, n: int, W: int) -> torch.Tensor:
    """(H, n) per-head offsets in 0..2W as a policy's table (ascending, -1 padded), each head its own,
    some without 0; the last head also reads offset W, the slot being written once past the window."""
    table = torch.full((H, n), -1, dtype=torch.long)
    for h in range(H):
        offs = torch.randperm(2 * W + 1, generator=g)[: int(torch.randint(1, n + 1, (1,), generator=g))]
        if h == H - 1:
            offs = torch.cat([offs[offs != W][: n - 1], torch.tensor([W])])
        table[h, : len(offs)] = offs.sort().values
    return table


def random_ring_case(B, H, Hkv, P, S, W, D, offsets, pos, dtype, seed, device="cpu"):
    """Inputs of fused ring decode attention for rows at ``pos`` (one or (B,)) and the reference's answer.

    Every entry the step must not read from memory is NaN: sinks from the query's own image index
    on (unwritten, or being written), the scratch sink slot, ring slots that no head of the kv head
    reads, and the slot being written. Returns the inputs (q, k_new, v_new, prompt_k, prompt_v,
    sink_k, sink_v, ring_k, ring_v, offsets, pos) on ``device`` and the reference's (out, the six
    buffers after the write), computed on the CPU.
    """
    from arsparse.kernels.reference import ring_decode_attention_ref

    g = torch.Generator().manual_seed(seed)
    G = H // Hkv
    pk, pv = (torch.randn(B, Hkv, P, D, generator=g) for _ in range(2))
    sk, sv = (torch.randn(B, Hkv, S + 1, D, generator=g) for _ in range(2))
    rk, rv = torch.full((B, Hkv, W, D), float("nan")), torch.full((B, Hkv, W, D), float("nan"))
    for b, p in enumerate(pos.expand(B).tolist()):
        i = p - P
        sk[b, :, min(i, S):] = float("nan")
        sv[b, :, min(i, S):] = float("nan")
        for h in range(H):
            read = [(p - o - P) % W for o in offsets[h].tolist() if o >= 0 and p - o >= P + S]
            read = [s for s in read if s != i % W]
            rk[b, h // G, read] = torch.randn(len(read), D, generator=g)
            rv[b, h // G, read] = torch.randn(len(read), D, generator=g)
    q, k_new, v_new = (torch.randn(B, h, D, generator=g) for h in (H, Hkv, Hkv))
    inputs = [t.to(dtype) for t in (q, k_new, v_new, pk, pv, sk, sv, rk, rv)]
    want_bufs = [t.clone() for t in inputs[3:]]
    want = ring_decode_attention_ref(*inputs[:3], *want_bufs, offsets, pos, S)
    return [t.to(device) for t in (*inputs, offsets, pos)], (want, *want_bufs)


@pytest.fixture(params=["c2i", "t2i"])
def model_type(request):
    return request.param


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Every float buffer a kernel wrapper allocates (output, weights, scratch) starts as NaN."""
    empty = torch.empty

    def nan_empty(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module, name, pointers, builds = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
for build, (const, warps, *must) in builds.items():
    const = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **const}
    signature = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n in ("scale", "eps") else "i32")
                 for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ok = bool(built.asm["cubin"]) and f".entry {name}" in built.asm["ptx"]
    ptx = built.asm["ptx"]
    def holds(m):  # a string the PTX holds, or "ld.global before wait >= N" (or <= N): loads issued before it
        if m.startswith("ld.global before wait"):
            op, n = m.split()[-2:]
            before = ptx.split("griddepcontrol.wait")[0].count("ld.global")
            return before >= int(n) if op == ">=" else before <= int(n)
        return m in ptx
    missing = [m for m in (must[0] if must else ()) if not holds(m)]
    print(build, "built" if ok and not missing else f"EMPTY-or-without-{missing}", flush=True)
"""


def compile_for_hopper(module: str, name: str, pointers: dict, builds: dict) -> None:
    """Build the Triton kernel ``module.name`` for sm_90 (Triton -> PTX -> cubin) in each of ``builds``
    ({build: (constexprs, num_warps[, strings its PTX must hold, or "ld.global before wait >= N" / "<= N":
    how many global loads it issues before its first ``griddepcontrol.wait``])}; ``pointers``: argument -> pointer
    type, the rest i32 or fp32),
    without a GPU, in a process of its own (the interpreter runs Python: only this shows that the
    compiled form accepts the code). Skips without Triton's NVIDIA backend or ptxas."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend is not installed")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([module, name, pointers, builds])], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode and "ptxas" in run.stderr and "not found" in run.stderr.lower():
        pytest.skip(f"no ptxas to assemble with: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [w for build in builds for w in (build, "built")], run.stdout
