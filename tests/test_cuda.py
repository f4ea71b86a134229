"""GPU checks (run on the lent GPU; skipped on CPU-only machines such as CI)."""
import random

import pytest
import torch

from arsparse.engine.generator import Generator
from conftest import random_cond, random_gpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_cuda_graph_generation_equals_eager(model_type):
    model = random_gpt(model_type, seed=4, image_tokens=64)
    cond = random_cond(model, 3)
    eager = Generator(model, device="cuda", dtype="bf16", cuda_graphs=False).sample_tokens(cond, seed=7, top_k=20)
    graph = Generator(model, device="cuda", dtype="bf16", cuda_graphs=True).sample_tokens(cond, seed=7, top_k=20)
    assert torch.equal(eager, graph)


def test_padding_to_a_bucket_does_not_change_images():
    model = random_gpt("c2i", seed=5, image_tokens=64)
    gen = Generator(model, device="cuda", dtype="fp32")
    three = gen.sample_tokens([1, 2, 3], seed=[10, 11, 12])  # bucket 4: one padded row
    one = gen.sample_tokens([2], seed=[11])
    assert torch.equal(three[1], one[0])


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-3), ("bf16", 3e-2)])
def test_triton_decode_matches_full_forward_on_gpu(dtype, tol):
    model = random_gpt("c2i", seed=6, image_tokens=256, n_kv_head=2)
    cond = random_cond(model, 4)
    tokens = torch.randint(0, model.config.vocab_size, (4, 256))
    gen = Generator(model, device="cuda", dtype=dtype, kernel="triton")
    got = gen.cached_logits(cond, tokens)
    with torch.no_grad():
        want = gen.gpt.logits(cond.cuda(), tokens.cuda()).float()
    assert (got - want).norm() / want.norm() < tol


@pytest.mark.parametrize("mode,policy", [(True, None), ("max-autotune-no-cudagraphs", None), (True, "h2o"),
                                         (True, "diagonal")])
def test_compiled_step_agrees_with_eager(mode, policy):
    """Compiled blocks (and, for a scored policy, its compiled slot write and bookkeeping; for an offset
    policy, RoPE in the ring kernel instead of the block) == eager."""
    import arsparse.policies as policies

    model = random_gpt("c2i", seed=8, image_tokens=64)
    cond = random_cond(model, 4)
    pol = policies.get(policy, rho=0.4) if policy else None
    eager = Generator(model, device="cuda", dtype="fp32", compile=False, policy=pol).sample_tokens(cond, seed=3)
    fused = Generator(model, device="cuda", dtype="fp32", compile=mode, policy=pol).sample_tokens(cond, seed=3)
    assert (eager == fused).float().mean() > 0.95  # fused kernels may round differently; rare flips


@pytest.mark.parametrize("policy", [dict(name="diagonal", local=3, rows=2, band=1, sinks=2),
                                    dict(name="h2o", rho=0.4), dict(name="tova", rho=0.4)])
def test_policy_caches_under_cuda_graphs_equal_eager(policy):
    import arsparse.policies as policies

    pol = policies.get(**policy)
    model = random_gpt("c2i", seed=10, image_tokens=64)
    cond = random_cond(model, 3)
    eager = Generator(model, device="cuda", dtype="fp32", cuda_graphs=False, policy=pol).sample_tokens(cond, seed=2)
    graph = Generator(model, device="cuda", dtype="fp32", cuda_graphs=True, policy=pol).sample_tokens(cond, seed=2)
    assert torch.equal(eager, graph)


@pytest.mark.parametrize("B,H,Hkv,P,C,D,splits", [
    (64, 20, 20, 1, 73, 64, None),  # GPT-XL-like heads at a c2i batch, rho ~ 1/8 of 576 tokens
    (8, 24, 8, 120, 300, 100, None),  # GQA, head_dim 100, a t2i prompt
    (2, 16, 2, 1, 1000, 128, 6),  # long tables over several splits
])
def test_slot_kernel_matches_reference_bf16_on_gpu(B, H, Hkv, P, C, D, splits):
    from arsparse.kernels.triton import slot_decode_attention
    from conftest import random_slot_tables

    inputs, (want_out, want_w) = random_slot_tables(B, H, Hkv, P, C, D, torch.bfloat16, seed=C, device="cuda")
    out, w = slot_decode_attention(*inputs, num_splits=splits)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.cpu(), want_w, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("policy", [dict(name="h2o", rho=0.4), dict(name="headkv", rho=0.5, calib_rows=2, recent=4)])
def test_scored_policy_triton_kernel_under_cuda_graphs(policy):
    """The slot kernel in the captured step: graph == eager (same kernel), and its logits == the torch path's."""
    import arsparse.policies as policies

    pol = policies.get(**policy)
    model = random_gpt("c2i", seed=12, image_tokens=64, n_kv_head=2)
    cond = random_cond(model, 3)
    runs = {graphs: Generator(model, device="cuda", dtype="bf16", cuda_graphs=graphs, kernel="triton",
                              policy=pol).sample_tokens(cond, seed=5, top_k=20) for graphs in (False, True)}
    assert torch.equal(runs[False], runs[True])
    tokens = runs[True].cpu()
    logits = {kernel: Generator(model, device="cuda", dtype="fp32", kernel=kernel, policy=pol)
              .cached_logits(cond, tokens) for kernel in ("torch", "triton")}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kmax", [1, 60])
def test_stratified_evict_kernels_match_torch_on_gpu(kmax):
    """HeadKV's eviction kernels at the bench's shape (256 images with guidance, 20 kv heads, 125 slots,
    24 rows): the slots torch's sort-based form frees, with tied scores; k = 1 every step, k up to 60
    the step a head's capacity drops."""
    from arsparse.kernels.triton.evict import stratified_evict_slots
    from arsparse.layout import Layout
    from arsparse.policies.headwise import stratified_evict

    lay = Layout(1, 24, 24)
    g = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    B, H, C = 512, 20, 125
    score = torch.rand(B, H, C, device="cuda", generator=g)
    score[:, :, ::3] = 0.5
    pos = torch.randint(1, 577, (B, H, C), device="cuda", generator=g)
    pos[torch.rand(B, H, C, device="cuda", generator=g) < 0.1] = -1
    ev = (pos >= 0) & (torch.rand(B, H, C, device="cuda", generator=g) < 0.7)
    k = torch.randint(0, kmax + 1, (B, H, 1), device="cuda", generator=g)
    assert torch.equal(stratified_evict_slots(score, pos, ev, k, lay), stratified_evict(score, pos, ev, k, lay))


# ---- the fused decode kernels (write + attend) at GPT-XL-like shapes, bf16 -----------------------

def _same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("B,H,Hkv,S,D,pos,splits", [
    (64, 20, 20, 577, 64, "rows", None),  # GPT-XL heads, 576 tokens, a position per row
    (64, 20, 20, 577, 64, 300, 1),  # one position, one split: the output written directly
    (4, 32, 8, 1120, 100, "rows", None),  # GQA, head_dim 100, t2i-like length, several splits
    (2, 16, 2, 1025, 128, 1024, 6),  # head_dim 128, the last position
])
@pytest.mark.parametrize("pdl,launch", [(0, {}), (1, {}), (1, dict(prefetch=1, block_n=64)),
                                        (0, dict(dot=0, small_dot=0)), (0, dict(dot=1, small_dot=1, num_warps=4))],
                         ids=["", "pdl", "pdl-prefetch", "cuda-cores", "dot-4warps"])
def test_fused_dense_kernel_matches_reference_bf16_on_gpu(B, H, Hkv, S, D, pos, splits, pdl, launch, monkeypatch):
    from arsparse.kernels.triton import _pdl, decode, decode_attention
    from conftest import random_decode_case

    monkeypatch.setattr(_pdl, "ENABLED", pdl)  # (split + combine launched with PDL: the same results)
    monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, **launch))
    inputs, (want, want_k, want_v) = random_decode_case(B, H, Hkv, S, D, pos, torch.bfloat16, S + D, "cuda")
    got = decode_attention(*inputs, num_splits=splits)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)
    _same(inputs[3:5], [want_k, want_v])


RING_VARIANTS = {  # ring_decode_attention's launch settings: the engine's, blocks of rows, cache-dtype tiles, grid order
    "engine": None,
    "rows3-late": dict(rows_per_program=3, late_cast=True, num_stages=1),
    "rows8": dict(rows_per_program=8, num_warps=4, num_stages=3),
    "rows5-nw2-heads-first": dict(rows_per_program=5, num_warps=2, heads_first=True),
    "three-tiles": dict(merged=False),
    "merged-late-nw2": dict(late_cast=True, num_warps=2),
}


@pytest.mark.parametrize("variant", list(RING_VARIANTS))
@pytest.mark.parametrize("H,Hkv,D", [(20, 20, 64), (32, 8, 100), (16, 2, 128)])
def test_fused_ring_kernel_matches_reference_bf16_on_gpu(variant, H, Hkv, D):
    """diagonal's default read set on the 24x24 grid, a position per row from the first image
    position to the last, then one position for every row (row blocks: a part-block of 24 rows)."""
    from arsparse.kernels.triton import ring_decode_attention
    from arsparse.layout import Layout
    from arsparse.policies import get
    from conftest import random_ring_case, row_positions

    lay, pol = Layout(1, 24, 24), get("diagonal")
    offsets = pol.offset_table(lay, 1, H)[0]
    W, S, B, P = pol.window(lay, 1, H), pol.sink_count(lay), 24, 1
    g = torch.Generator().manual_seed(H + D)
    pos = row_positions(g, B, P, P + 574, [P, P + S - 1, P + S, P + W, P + 574])
    for p in (pos, pos[3]):
        inputs, (want, *want_bufs) = random_ring_case(B, H, Hkv, P, S, W, D, offsets, p, torch.bfloat16,
                                                      int(p.sum()), "cuda")
        got = ring_decode_attention(*inputs, S, launch=RING_VARIANTS[variant])
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)
        _same(inputs[3:9], want_bufs)


@pytest.mark.parametrize("policy", [None, dict(local=3, rows=2, band=1, sinks=2)])
def test_triton_engine_equals_torch_engine_on_gpu(policy):
    """Fused kernels in the whole engine (fp32): logits == the PyTorch path; CUDA-graph tokens ==
    eager tokens; continuous batching (a position per row) == the offline generator."""
    import arsparse.policies as policies
    from arsparse.engine.continuous import SlotDecoder
    from test_serve_engine import _offline, _requests, _serve

    pol = policies.get("diagonal", **policy) if policy else None
    model = random_gpt("c2i", seed=13, image_tokens=64, n_kv_head=2)
    cond = random_cond(model, 4)  # a full bucket: the graphed and the eager step have the same shapes
    tokens = torch.randint(0, model.config.vocab_size, (4, 64))
    gens = {k: Generator(model, device="cuda", dtype="fp32", kernel=k, policy=pol, cuda_graphs=False)
            for k in ("torch", "triton")}
    logits = {k: gen.cached_logits(cond, tokens) for k, gen in gens.items()}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-3, rtol=1e-3)
    graphed = Generator(model, device="cuda", dtype="fp32", kernel="triton", policy=pol, cuda_graphs=True)
    assert torch.equal(graphed.sample_tokens(cond, seed=4), gens["triton"].sample_tokens(cond, seed=4))
    reqs = _requests(model, 6, seed=8)
    results, joined = _serve(SlotDecoder(gens["triton"], slots=8, guidance=True, cuda_graphs=True), reqs,
                             [0, 1, 2, 20, 21, 40])
    assert joined >= 2
    for i, r in enumerate(reqs):
        assert torch.equal(results[i], _offline(gens["torch"], r)), f"request {i}"


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-3), ("bf16", 5e-2)])
def test_remainder_triton_engine_equals_torch_engine_on_gpu(dtype, tol):
    """diagonal:remainder=1 through the Triton ring kernel (rest_sums): logits == the PyTorch path and
    == teacher forcing; CUDA-graph tokens == eager tokens; the Generator's default kernel is Triton."""
    import arsparse.policies as policies

    pol = policies.get("diagonal", local=3, rows=2, band=1, sinks=2, remainder=True)
    model = random_gpt("c2i", seed=14, image_tokens=64, n_kv_head=2)
    cond = random_cond(model, 4)
    tokens = torch.randint(0, model.config.vocab_size, (4, 64))
    assert Generator(model, device="cuda", dtype=dtype, policy=pol).kernel == "triton"
    gens = {k: Generator(model, device="cuda", dtype=dtype, kernel=k, policy=pol, cuda_graphs=False)
            for k in ("torch", "triton")}
    logits = {k: gen.cached_logits(cond, tokens).float() for k, gen in gens.items()}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=tol, rtol=tol)
    with torch.no_grad():
        forced = model.logits(cond.cuda(), tokens.cuda(), policy=pol).float()
    torch.testing.assert_close(logits["triton"], forced, atol=tol, rtol=tol)
    graphed = Generator(model, device="cuda", dtype=dtype, kernel="triton", policy=pol, cuda_graphs=True)
    assert torch.equal(graphed.sample_tokens(cond, seed=4), gens["triton"].sample_tokens(cond, seed=4))


# ---- t2i caption padding masks (LlamaGen's emb_masks): the kernels and the engine --------------

def _spans(B: int, P: int, seed: int) -> torch.Tensor:
    """(B, 2) int32 [start, end): left padding (most rows), right padding, one real token, none."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, P + 1, (B,), generator=g)
    n[:3] = torch.tensor([1, P, P - 1])[: min(B, 3)]
    start = torch.where(torch.arange(B) % 4 == 3, torch.zeros_like(n), P - n)  # every 4th row right-padded
    return torch.stack([start, start + n], 1).int()


def _poison_prompt(t: torch.Tensor, span: torch.Tensor, P: int) -> None:
    for b in range(t.shape[0]):
        t[b, :, : span[b, 0]] = float("nan")
        t[b, :, span[b, 1]: P] = float("nan")


@pytest.mark.parametrize("B,H,Hkv,S,D,splits", [(16, 24, 8, 377, 100, None), (4, 16, 16, 377, 64, 1)])
def test_masked_dense_kernel_matches_reference_bf16_on_gpu(B, H, Hkv, S, D, splits):
    from arsparse.kernels.reference import decode_attention_ref
    from arsparse.kernels.triton import decode_attention
    from conftest import row_positions

    P = 120
    g = torch.Generator().manual_seed(S + D)
    q, kn, vn = (torch.randn(B, h, D, generator=g).bfloat16() for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g).bfloat16() for _ in range(2))
    pos = row_positions(g, B, P, S - 1, [P, S - 1, P + 1])
    span = _spans(B, P, S)
    for t in (kc, vc):
        _poison_prompt(t, span, P)
    want = decode_attention_ref(q, kn, vn, kc.clone(), vc.clone(), pos, prompt_span=span, prompt_len=P)
    got = decode_attention(*(t.cuda() for t in (q, kn, vn, kc, vc, pos)), num_splits=splits,
                           prompt_span=span.cuda(), prompt_len=P)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", list(RING_VARIANTS))
@pytest.mark.parametrize("P", [120, 8])
def test_masked_ring_kernel_matches_reference_bf16_on_gpu(variant, P):
    """A t2i prompt with caption padding (NaN), GQA, head_dim 100, the remainder entry. P=120 keeps the
    prompt's own tile (ring.MERGED_ROWS); P=8 fits diagonal's one tile with the ring entries and sinks."""
    from arsparse.kernels.reference import ring_decode_attention_ref
    from arsparse.kernels.triton import ring_decode_attention
    from arsparse.layout import Layout
    from arsparse.policies import get
    from conftest import random_ring_case, row_positions

    H, Hkv, D, B = 24, 8, 100, 16
    lay, pol = Layout(P, 16, 16), get("diagonal")
    offsets = pol.offset_table(lay, 1, H)[0]
    W, S = pol.window(lay, 1, H), pol.sink_count(lay)
    g = torch.Generator().manual_seed(7)
    pos = row_positions(g, B, P, P + 254, [P, P + S, P + 254])
    span = _spans(B, P, 8)
    inputs, _ = random_ring_case(B, H, Hkv, P, S, W, D, offsets, pos, torch.bfloat16, 9)
    for t in inputs[3:5]:
        _poison_prompt(t, span, P)
    sums = [torch.randn(B, Hkv, D, generator=g).mul_(5) for _ in range(2)]
    want = ring_decode_attention_ref(*inputs[:3], *[t.clone() for t in inputs[3:9]], offsets, pos, S, prompt_span=span,
                                     rest_sums=sums)
    got = ring_decode_attention(*(t.cuda() for t in inputs), S, prompt_span=span.cuda(), launch=RING_VARIANTS[variant],
                                rest_sums=[t.cuda() for t in sums])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=1e-2, rtol=1e-2)


def test_masked_slot_kernel_matches_reference_bf16_on_gpu():
    from arsparse.kernels.reference import slot_decode_attention_ref
    from arsparse.kernels.triton import slot_decode_attention
    from conftest import random_slot_tables

    B, H, Hkv, P, C, D = 16, 24, 8, 120, 300, 100
    (q, pk, pv, k, v, spos), _ = random_slot_tables(B, H, Hkv, P, C, D, torch.bfloat16, seed=3)
    span = _spans(B, P, 4)
    want_out, want_w = slot_decode_attention_ref(q, pk, pv, k.nan_to_num(), v.nan_to_num(), spos, prompt_span=span)
    for t in (pk, pv):
        _poison_prompt(t, span, P)
    out, w = slot_decode_attention(*(t.cuda() for t in (q, pk, pv, k, v, spos)), prompt_span=span.cuda())
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.cpu(), want_w, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("policy", [None, dict(name="diagonal", local=3, rows=2, band=1, sinks=2), dict(name="h2o", rho=0.8)])
def test_masked_t2i_engine_on_gpu(policy):
    """A t2i model with a 120-token padded prompt: Triton logits == PyTorch logits == masked teacher
    forcing; CUDA-graph tokens == eager tokens; an all-True mask gives the unmasked tokens."""
    import arsparse.policies as policies

    pol = policies.get(**policy) if policy else None
    model = random_gpt("t2i", seed=14, image_tokens=64, cls_token_num=120, caption_dim=12, n_kv_head=2)
    cond = random_cond(model, 4)
    span = _spans(4, 120, 5)
    j = torch.arange(120)
    mask = (j >= span[:, :1]) & (j < span[:, 1:])
    tokens = torch.randint(0, model.config.vocab_size, (4, 64))
    gens = {k: Generator(model, device="cuda", dtype="fp32", kernel=k, policy=pol, cuda_graphs=False)
            for k in ("torch", "triton")}
    logits = {k: gen.cached_logits(cond, tokens, prompt_mask=mask) for k, gen in gens.items()}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-3, rtol=1e-3)
    with torch.no_grad():
        want = gens["torch"].gpt.logits(cond.cuda(), tokens.cuda(), policy=pol, prompt_mask=mask).float()
    torch.testing.assert_close(logits["torch"], want, atol=1e-3, rtol=1e-3)
    graphed = Generator(model, device="cuda", dtype="fp32", kernel="triton", policy=pol, cuda_graphs=True)
    eager = gens["triton"].sample_tokens(cond, seed=4, cfg_scale=2.0, prompt_mask=mask)
    assert torch.equal(graphed.sample_tokens(cond, seed=4, cfg_scale=2.0, prompt_mask=mask), eager)
    full = torch.ones_like(mask)
    assert torch.equal(graphed.sample_tokens(cond, seed=4, prompt_mask=full), graphed.sample_tokens(cond, seed=4))


@pytest.mark.parametrize("policy,compile", [(None, False), ("diagonal", True)])
def test_two_streams_in_one_graph_give_the_same_images_on_gpu(policy, compile):
    """streams=2: two half batches captured into one CUDA graph on two streams (fp32, Triton kernels;
    compiled blocks too) sample one runner's tokens."""
    model = random_gpt("c2i", seed=15, image_tokens=64, n_kv_head=2)
    cond = random_cond(model, 6)
    make = lambda s: Generator(model, device="cuda", dtype="fp32", kernel="triton", policy=policy,  # noqa: E731
                               compile=compile, streams=s)
    one = make(1).sample_tokens(cond, seed=3, cfg_scale=2.0)
    gen = make(2)
    assert torch.equal(gen.sample_tokens(cond, seed=3, cfg_scale=2.0), one)
    assert gen._runner.graph is not None and len(gen._runner.halves) == 2


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-3), ("bf16", 3e-2)])
def test_matvec_blocks_decode_matches_full_forward_on_gpu(dtype, tol):
    """Teacher forcing through the decode path with the matvec halves (2 rows: the steps and the
    one-position prefill take the kernels) against the full forward pass."""
    model = random_gpt("c2i", seed=6, image_tokens=256, n_kv_head=2)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 256))
    gen = Generator(model, device="cuda", dtype=dtype, kernel="triton", matvec=True)
    got = gen.cached_logits(cond, tokens)
    with torch.no_grad():
        gen.gpt.unfuse()
        want = gen.gpt.logits(cond.cuda(), tokens.cuda()).float()
    assert (got - want).norm() / want.norm() < tol


@pytest.mark.parametrize("policy,early,merged", [(None, False, True), ("diagonal", False, True),
                                                 ("diagonal", True, True), ("diagonal", True, False)])
def test_programmatic_dependent_launch_changes_no_token_on_gpu(policy, early, merged, monkeypatch):
    """PDL (kernels/triton/_pdl.py): each decode kernel starts beside the last programs of the one
    before and waits for it before reading what the step writes. Latency mode in bf16 (matvec, split +
    combine or ring kernels back to back), the step in a CUDA graph: the same tokens and teacher-forced
    logits, bit for bit, as plain launches (a read before its input was written would change them).
    ``early``: the ring kernel's gathers issued before its wait (``ring.LAUNCH["early_loads"]``); ``merged``:
    its one-tile form."""
    from arsparse.kernels.triton import _pdl, ring

    model = random_gpt("c2i", seed=16, image_tokens=256, n_kv_head=2)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 256))
    make = lambda: Generator(model, device="cuda", dtype="bf16", kernel="triton", policy=policy,  # noqa: E731
                             matvec=True)
    monkeypatch.setitem(ring.LAUNCH, "merged", merged)
    monkeypatch.setattr(_pdl, "ENABLED", 0)
    plain = make()
    want, want_logits = plain.sample_tokens(cond, seed=5, cfg_scale=2.0), plain.cached_logits(cond, tokens)
    monkeypatch.setattr(_pdl, "ENABLED", 1)
    monkeypatch.setitem(ring.LAUNCH, "early_loads", early)
    assert _pdl.pdl_args(torch.device("cuda"))["PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    gen = make()
    assert torch.equal(gen.sample_tokens(cond, seed=5, cfg_scale=2.0), want)
    assert gen._runner.graph is not None
    assert torch.equal(gen.cached_logits(cond, tokens), want_logits)


def test_tensor_core_dense_kernel_in_the_engine_on_gpu(monkeypatch):
    """decode.LAUNCH["dot"]: the dense split kernel's products on tensor cores (probabilities in bf16, as
    FlashAttention). The whole engine in bf16, MHA and GQA, graph-captured steps: the teacher-forced
    logits within bf16 noise of the CUDA-core form's (the same argmax almost everywhere)."""
    from arsparse.kernels.triton import decode

    for kv in (None, 2):
        model = random_gpt("c2i", seed=18, image_tokens=256, **({} if kv is None else dict(n_kv_head=kv)))
        cond = random_cond(model, 4)
        tokens = torch.randint(0, model.config.vocab_size, (4, 256))
        make = lambda: Generator(model, device="cuda", dtype="bf16", kernel="triton")  # noqa: E731
        monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, dot=0, small_dot=0))
        want = make().cached_logits(cond, tokens).float()
        monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, dot=1, small_dot=1))
        got = make().cached_logits(cond, tokens).float()
        assert (got - want).norm() / want.norm() < 2e-2
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
        monkeypatch.undo()


@pytest.mark.parametrize("M", [1, 2, 16])
def test_matvec_ops_at_gpt_xl_shapes_bf16_on_gpu(M, monkeypatch):
    """GPT-XL's projections (dim 1280, 20 heads of 64, SwiGLU 3584) against the torch composition."""
    import torch.nn.functional as F

    from arsparse.kernels.triton.matvec import matvec
    from arsparse.models.gpt import rms_norm

    g = torch.Generator(device="cuda").manual_seed(M)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    x, f, nw = r(M, 1280), r(M, 1280), 1 + 0.1 * r(1280)
    wqkv, w1, w3, w2 = r(3840, 1280) / 36, r(3584, 1280) / 36, r(3584, 1280) / 36, r(1280, 3584) / 60
    tol = dict(atol=3e-2, rtol=3e-2)
    y, xs = matvec(x, wqkv, add=f, norm=(nw, 1e-5))
    torch.testing.assert_close(xs, x + f, atol=0, rtol=0)
    torch.testing.assert_close(y, F.linear(rms_norm(x + f, nw, 1e-5), wqkv), **tol)
    h = rms_norm(x, nw, 1e-5)
    torch.testing.assert_close(matvec(x, w1, norm=(nw, 1e-5), w_up=w3), F.silu(F.linear(h, w1)) * F.linear(h, w3), **tol)
    gate = r(M, 3584)
    torch.testing.assert_close(matvec(gate, w2, residual=x), x + F.linear(gate, w2), **tol)
    # launched with PDL (the weights asked for before the wait): no bit changes
    from arsparse.kernels.triton import _pdl

    monkeypatch.setattr(_pdl, "ENABLED", 0)
    plain = matvec(x, wqkv, norm=(nw, 1e-5)), matvec(gate, w2, residual=x)
    monkeypatch.setattr(_pdl, "ENABLED", 1)
    assert torch.equal(matvec(x, wqkv, norm=(nw, 1e-5)), plain[0]) and torch.equal(matvec(gate, w2, residual=x), plain[1])
