"""Sparse-attention policies: read sets by hand, eviction safety, budgets, and agreement with dense."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arsparse.policies as policies
from arsparse.engine.generator import Generator, _Plan, _Runner
from arsparse.layout import Layout
from arsparse.policies import PolicyError
from conftest import random_cond, random_gpt

OFFSET = ["streaming", "diagonal"]
SCORED = ["h2o", "tova", "lines", "adsa"]


def test_registry_lists_every_policy_with_a_source():
    got = policies.names()
    for name in ["dense", *OFFSET, *SCORED]:
        assert name in got
        d = policies.get(name).describe()
        assert d["source"] and d["name"] == name and isinstance(d["params"], dict)


def test_diagonal_read_sets_by_hand():
    """4x6 grid after a 2-token prompt: position = 2 + 6 * row + col."""
    lay = Layout(prefix_len=2, grid_h=4, grid_w=6)
    pol = policies.get("diagonal", local=2, rows=1, band=1, sinks=0)
    # (row 1, col 2) = 10: prompt, itself and the previous token, and cols 1..3 of row 0.
    assert pol.read_positions(lay, 10) == [0, 1, 3, 4, 5, 9, 10]
    # Left edge (row 2, col 0) = 14: the band around 8 wraps to the right end of row 0 (position 7).
    assert pol.read_positions(lay, 14) == [0, 1, 7, 8, 9, 13, 14]
    # Right edge (row 1, col 5) = 13: the band around 7 wraps onto the start of row 1 (position 8).
    assert pol.read_positions(lay, 13) == [0, 1, 6, 7, 8, 12, 13]
    # First row: no row above; the band around q - 6 falls into the prompt (kept anyway) or nowhere.
    assert pol.read_positions(lay, 4) == [0, 1, 3, 4]
    two = policies.get("diagonal", local=1, rows=2, band=0, sinks=2)
    # (row 3, col 3) = 23: sinks 2, 3; the tokens straight above, 17 and 11; itself.
    assert two.read_positions(lay, 23) == [0, 1, 2, 3, 11, 17, 23]


def test_streaming_read_set_by_hand():
    lay = Layout(prefix_len=1, grid_h=3, grid_w=5)
    pol = policies.get("streaming", sinks=2, recent=3)
    assert pol.read_positions(lay, 12) == [0, 1, 2, 10, 11, 12]
    assert pol.read_positions(lay, 3) == [0, 1, 2, 3]  # recent window overlapping the sinks


@settings(max_examples=60, deadline=None)
@given(P=st.integers(0, 3), gh=st.integers(2, 6), gw=st.integers(2, 7), extra=st.integers(0, 2),
       local=st.integers(1, 5), rows=st.integers(0, 3), band=st.integers(0, 3), sinks=st.integers(0, 3))
def test_offset_policies_never_read_what_they_evicted(P, gh, gw, extra, local, rows, band, sinks):
    lay = Layout(P, gh, gw, row_stride=gw + extra)
    rows = min(rows, gh - 1)
    band = min(band, lay.row_stride - 1)
    pol = policies.get("diagonal", local=local, rows=rows, band=band, sinks=sinks)
    W = pol.window(lay)
    S = min(sinks, lay.image_tokens - 1)
    last = P + lay.image_tokens - 1
    evicted = set()
    for q in range(P, last):
        held = set(range(min(P + S, q + 1))) | {p for p in range(max(P, q - W + 1), q + 1)}
        reads = set(pol.read_positions(lay, q))
        assert reads <= held, (q, reads - held)
        assert not reads & evicted
        evicted |= {p for p in range(P + S, q + 1) if p not in held}


def test_ring_cache_decode_equals_masked_teacher_forcing():
    model = random_gpt("c2i", seed=11, image_tokens=36)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 36))
    dense = model.logits(cond, tokens)
    for pol in [policies.get("diagonal", local=2, rows=1, band=1, sinks=1), policies.get("streaming", sinks=2, recent=5)]:
        cached = Generator(model, device="cpu", policy=pol).cached_logits(cond, tokens)
        with torch.no_grad():
            masked = model.logits(cond, tokens, policy=pol)
        torch.testing.assert_close(cached, masked, atol=1e-4, rtol=1e-4)
        assert (masked - dense).abs().max() > 0.1  # the policy really skips something


def test_dense_policy_is_exactly_the_engine():
    model = random_gpt("c2i", seed=12)
    cond = random_cond(model, 3)
    plain = Generator(model, device="cpu").sample_tokens(cond, seed=4)
    dense = Generator(model, device="cpu", policy="dense").sample_tokens(cond, seed=4)
    assert torch.equal(plain, dense)
    tokens = torch.randint(0, 48, (3, 16))
    with torch.no_grad():
        assert torch.equal(model.logits(cond, tokens, policy="dense"), model.logits(cond, tokens))


@pytest.mark.parametrize("name,kw", [
    ("diagonal", dict(local=36)), ("streaming", dict(recent=36, sinks=0)),
    ("h2o", dict(rho=1.0)), ("tova", dict(rho=1.0)), ("lines", dict(rho=1.0)), ("adsa", dict(rho=1.0)),
])
def test_policies_that_cover_everything_give_the_dense_result(name, kw):
    model = random_gpt("c2i", seed=13, image_tokens=36)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, 48, (2, 36))
    pol = policies.get(name, **kw)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(cond, tokens, policy=pol), model.logits(cond, tokens),
                                   atol=1e-4, rtol=1e-4)
    gen = Generator(model, device="cpu", policy=pol)
    assert torch.equal(gen.sample_tokens(cond, seed=1, top_k=1), Generator(model, device="cpu").sample_tokens(cond, seed=1, top_k=1))


@pytest.mark.parametrize("name", SCORED)
def test_scored_policies_respect_budget_and_evict_the_lowest_score(name):
    model = random_gpt("c2i", seed=14, image_tokens=36)
    cfg = model.config
    kw = dict(rho=0.45) if name != "adsa" else dict(rho=0.45, local=3)
    if name == "lines":
        kw.update(recent_rows=1, anchors=1)
    pol = policies.get(name, **kw)
    cap = pol.capacity(model.layout)
    cond = random_cond(model, 3)
    tokens = torch.randint(0, cfg.vocab_size, (3, 36))
    run = _Runner(model, _Plan(3, False, 0, False), torch.device("cpu"), False, policy=pol)
    cache = run.cache
    evictions = 0
    with torch.no_grad():
        run.prefill_logits(cond)
        for t in range(1, 36):
            before = cache.spos.clone()
            q = cache.pos.clone()
            run.cur.copy_(tokens[:, t - 1])
            run.step_logits()
            kept = cache.kept()
            assert int(kept.max()) <= cap
            assert torch.equal(kept, torch.minimum(torch.full_like(kept, t), torch.tensor(cap)))
            for li in range(cfg.n_layer):
                for b in range(3):
                    for h in range(cfg.kv_heads):
                        had = set(before[li, b, h][before[li, b, h] >= 0].tolist()) | {int(q)}
                        now_pos = cache.spos[li, b, h]
                        gone = had - set(now_pos[now_pos >= 0].tolist())
                        assert len(gone) <= 1
                        if not gone:
                            continue
                        evictions += 1
                        (p,) = gone
                        score = cache.score[li, b, h]
                        slot_p = int((before[li, b, h] == p).nonzero()[0]) if p != int(q) else None
                        assert slot_p is not None, "the token just written was evicted"
                        prot = pol.protected(now_pos, q, model.layout)
                        others = (now_pos >= 0) & ~prot
                        rank = pol.eviction_score(score, now_pos, model.layout)
                        assert rank[slot_p] <= rank[others].min() + 1e-6
    assert evictions > 0


@pytest.mark.parametrize("name,kw,msg", [
    ("diagonal", dict(band=-1), "band must be an integer >= 0"),
    ("diagonal", dict(rows=-2), "rows must be an integer >= 0"),
    ("diagonal", dict(local=0), "local must be an integer >= 1"),
    ("diagonal", dict(rho=1.5), r"rho .* must be in \(0, 1\]"),
    ("h2o", dict(rho=0.0), r"rho .* must be in \(0, 1\]"),
    ("h2o", dict(recent=1.0), r"recent .* must be in \[0, 1\)"),
    ("streaming", dict(recent=0), "recent must be an integer >= 1"),
    ("diagonal", dict(width=3), r"unknown parameter\(s\) \['width'\]; allowed: \['local', 'rows', 'band', 'sinks', 'rho', 'remainder'\]"),
    ("nope", {}, "unknown policy 'nope'; choose one of dense"),
])
def test_bad_parameters_say_what_is_allowed(name, kw, msg):
    with pytest.raises(PolicyError, match=msg):
        policies.get(name, **kw)


def test_budgets_that_do_not_fit_the_image_are_rejected():
    model = random_gpt("c2i", image_tokens=36)  # 6 x 6
    with pytest.raises(PolicyError, match="rows=6 reaches beyond the 6-row image"):
        Generator(model, device="cpu", policy=policies.get("diagonal", rows=6))
    with pytest.raises(PolicyError, match="band=6 must be below the row stride"):
        Generator(model, device="cpu", policy=policies.get("diagonal", rows=1, band=6))
    with pytest.raises(PolicyError, match="too small for even one row"):
        policies.get("diagonal", rho=0.05).offsets(model.layout)
    with pytest.raises(PolicyError, match="fewer than"):
        Generator(model, device="cpu", policy=policies.get("lines", rho=0.2))


def test_budget_reports_and_rho_selection():
    lay = Layout(1, 24, 24)  # LlamaGen 384 px
    d = policies.get("diagonal", local=4, rows=3, band=2, sinks=0).budget(lay)
    assert d.dense == 576
    assert d.kept == 1 + 3 * 24 + 2 + 1  # prompt + ring up to offset 3W+2
    assert 1 + 4 + 3 * 5 - 2 <= d.read <= 1 + 4 + 3 * 5
    sel = policies.get("diagonal", rho=0.25)
    assert sel.budget(lay).rho <= 0.25 and sel.n_rows(lay) == 5
    h = policies.get("h2o", rho=0.25).budget(lay)
    assert h.kept == 144 and abs(h.rho - 0.25) < 1e-9


def test_ring_and_slot_caches_free_memory():
    model = random_gpt("c2i", image_tokens=64)
    cfg = model.config
    dense = Generator(model, device="cpu")._runner_for(_Plan(2, False, 0, False)).cache.nbytes()
    ring = policies.get("diagonal", local=2, rows=1, band=1, sinks=0).make_cache(cfg, 2, torch.float32, "cpu").nbytes()
    slot = policies.get("h2o", rho=0.25).make_cache(cfg, 2, torch.float32, "cpu")
    assert ring < dense / 4
    assert slot.k.numel() * 2 * 4 < dense / 2


def test_throughput_mode_turns_freed_memory_into_batch():
    from arsparse.engine.throughput import cache_bytes_per_sequence, max_batch
    from arsparse.models.config import gpt_config
    from arsparse.models.gpt import GPT

    with torch.device("meta"):
        gpt = GPT(gpt_config("GPT-XL", image_tokens=576))
    cfg = gpt.config
    dense = cache_bytes_per_sequence(gpt)
    assert dense == 2 * cfg.n_layer * cfg.kv_heads * cfg.seq_len * cfg.head_dim * 2  # K and V in bf16
    diag = policies.get("diagonal")
    ring = cache_bytes_per_sequence(gpt, diag)
    kept = diag.budget(gpt.layout).kept
    assert abs(ring / dense - kept / cfg.seq_len) < 0.02
    mem = 120 << 30
    b_dense, b_diag = max_batch(gpt, None, mem), max_batch(gpt, diag, mem)
    assert 350 < b_dense < 700  # ~54 GB for 256 images, as measured on the H200
    assert b_diag > 4 * b_dense
    with pytest.raises(ValueError, match="do not fit even one image"):
        max_batch(gpt, None, 1 << 30)
    # with memory to spare, the Triton kernels' 32-bit offsets bound one layer's K: kv heads x positions x dim
    per_seq = cfg.kv_heads * cfg.seq_len * cfg.head_dim
    assert max_batch(gpt, None, 1 << 50) == (2**31 - 1) // per_seq // 2
    assert max_batch(gpt, None, 1 << 50, guidance=False) == (2**31 - 1) // per_seq


def test_bench_ratios_against_dense():
    from arsparse.bench import _add_ratios

    rows = [dict(policy="dense", kernel="triton", batch=256, max_batch=False, images_per_s=30.0),
            dict(policy="dense", kernel="triton", batch=500, max_batch=True, images_per_s=40.0),
            dict(policy="diagonal:rows=2", kernel="triton", batch=256, max_batch=False, images_per_s=75.0),
            dict(policy="diagonal:rows=2", kernel="triton", batch=4000, max_batch=True, images_per_s=200.0)]
    _add_ratios(rows)
    assert rows[2]["x_dense_same_batch"] == 2.5 and rows[2]["x_dense_max_batch"] is None
    assert rows[3]["x_dense_max_batch"] == 5.0 and rows[3]["x_dense_same_batch"] is None
    # a variant's rows are compared with dense in the same variant
    rows += [dict(policy="dense", kernel="triton", batch=256, max_batch=False, images_per_s=20.0, variant="streams=2"),
             dict(policy="diagonal:rows=2", kernel="triton", batch=256, max_batch=False, images_per_s=90.0,
                  variant="streams=2")]
    _add_ratios(rows)
    assert rows[2]["x_dense_same_batch"] == 2.5 and rows[5]["x_dense_same_batch"] == 4.5
    # against the fastest dense row of any variant: the same batch, or each at its max batch
    rows.append(dict(policy="dense", kernel="triton", batch=480, max_batch=True, images_per_s=50.0, variant="dot"))
    _add_ratios(rows)
    assert [r["x_fastest_dense"] for r in rows] == [1.0, 0.8, 2.5, 4.0, 20 / 30, 3.0, 1.0]
    assert rows[3]["x_dense_max_batch"] == 5.0  # (against dense in its own variant, as before)


@pytest.mark.parametrize("model_type,kw", [("c2i", {}), ("t2i", dict(n_kv_head=1)), ("c2i", dict(dim=300, n_head=3))])
def test_bench_step_flops_count_the_models_projections(model_type, kw):
    """step_flops: 2 per weight of every nn.Linear a decode step runs (the blocks' and the output head's,
    not the caption embedder's, which runs in prefill), per row; attention 4 per entry read, per head
    dimension, head, layer and row (MHA, MQA, head dim 100 as GPT-3B)."""
    import random

    from arsparse.bench import step_flops

    gpt = random_gpt(model_type, seed=random.randrange(2**31), **kw)
    rows, read = random.randint(1, 600), random.uniform(1, 300)
    weights = sum(m.weight.numel() for n, m in gpt.named_modules()
                  if isinstance(m, torch.nn.Linear) and (n.startswith("layers.") or n == "output"))
    cfg = gpt.config
    products, attention = step_flops(cfg, rows, read)
    assert products == 2 * rows * weights
    assert attention == pytest.approx(4 * rows * cfg.n_layer * cfg.n_head * cfg.head_dim * read, rel=1e-12)


def test_bench_arithmetic_floor_bounds():
    """The arithmetic floor: never below the bandwidth floor; equal to it when FLOPs are free; the FLOP
    time of both phases when bytes are free; each phase the longer of its two times."""
    import random

    from arsparse.bench import step_floors

    w, kv, prod, att, bw, rate = (random.uniform(1e8, 1e10) for _ in range(6))
    byte_ms, arith_ms = step_floors(w, kv, (prod, att), bw, rate)
    assert byte_ms == pytest.approx((w + kv) / bw * 1e3) and arith_ms >= byte_ms * (1 - 1e-12)
    assert step_floors(w, kv, (prod, att), bw, float("inf"))[1] == pytest.approx(byte_ms)
    assert step_floors(w, kv, (prod, att), float("inf"), rate)[1] == pytest.approx((prod + att) / rate * 1e3)
    assert step_floors(1.0, 1.0, (5.0, 0.5), 1.0, 1.0) == (2e3, 6e3)  # (products 5 s, then K/V 1 s)


def test_bench_picture_of_the_rows(tmp_path):
    """plot_bench draws every row (with or without an arithmetic floor: older JSON) into a PNG."""
    pytest.importorskip("matplotlib")
    import random

    from PIL import Image

    from arsparse.bench import _add_ratios, plot_bench

    rows = []
    for i, policy in enumerate(["dense", "diagonal", "h2o:rho=0.14", "dense"]):
        ms = random.uniform(1, 20)
        rows.append(dict(policy=policy, kernel="triton", batch=256 if i < 3 else 500, max_batch=i == 3,
                         variant="dense.dot=1" if i == 3 else "", ms_per_step=ms, floor_ms_per_step=ms / 2,
                         images_per_s=random.uniform(5, 100), **({"arith_floor_ms_per_step": ms / 1.5} if i % 2 else {})))
    _add_ratios(rows)
    path = tmp_path / "bench.png"
    plot_bench(dict(gpu="GPU", model="GPT-XL", tokens=576, torch="x", rows=rows), path)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 1000 and im.size[1] > 200


def test_bench_match_budget_gives_each_policy_diagonals_memory():
    """bench_policies(match_budget=True): a policy with an unset rho keeps the most entries that fit in the
    listed diagonal's (streaming and the scored policies exactly as many; headkv, which pads its tables,
    at most as many, and one entry more would not fit); an explicit rho, dense and diagonal are kept
    as given; labels name the rho chosen. Without it, the specs as written."""
    import random

    from arsparse.bench import bench_policies

    lay = Layout(random.choice([1, 4]), random.randint(12, 24), random.randint(12, 24))
    L, H = 3, 4
    rows = random.randint(2, 4)
    specs = ["dense", f"diagonal:rows={rows}", "streaming", "h2o", "tova", "lines", "headkv", "h2o:rho=0.5"]
    got = bench_policies(specs, lay, L, H, match_budget=True)
    target = policies.get("diagonal", rows=rows).budget(lay, L, H).kept
    assert [label.split(":")[0] for label, _ in got] == [s.split(":")[0] for s in specs]
    assert got[0] == ("dense", policies.get("dense")) and got[1][1] == policies.get("diagonal", rows=rows)
    for label, pol in got[2:6]:
        assert pol.budget(lay, L, H).kept == target and label.endswith(f"rho={pol.rho:.4f}")
    label, headkv = got[6]
    dense = lay.prefix_len + lay.image_tokens - 1  # (the prompt and every image token but the last)
    one_more = policies.get("headkv", rho=(round(headkv.rho * dense - 0.5) + 1.5) / dense)
    assert headkv.budget(lay, L, H).kept <= target < one_more.budget(lay, L, H).kept
    assert headkv.rho < got[2][1].rho  # (its padding costs it uniform capacity)
    assert got[7] == ("h2o:rho=0.5", policies.get("h2o", rho=0.5))
    # diagonal's defaults are the reference when none is listed; without matching, the specs as written
    default = policies.get("diagonal").budget(lay, L, H).kept
    assert bench_policies(["streaming"], lay, L, H, True)[0][1].budget(lay, L, H).kept == default
    assert bench_policies(specs, lay, L, H) == [(s, policies.resolve(s)) for s in specs]
    with pytest.raises(PolicyError, match="unknown policy 'h3o'"):
        bench_policies(["dense", "h3o"], lay, L, H, True)


def test_bench_variants_parse_apply_and_restore():
    pytest.importorskip("triton")
    from arsparse.bench import _applied, markdown_table, parse_variant
    from arsparse.kernels.triton import _pdl, decode, matvec, ring, slots
    from arsparse.models import gpt

    def settings():
        return dict(ring.LAUNCH), dict(matvec.LAUNCH), dict(decode.LAUNCH), _pdl.ENABLED, gpt.MERGE_FFN, dict(slots.LAUNCH)

    flip, w13, pre = 1 - _pdl.ENABLED, 1 - int(gpt.MERGE_FFN), 1 - decode.LAUNCH["prefetch"]
    v = parse_variant(f" ring.rows_per_program=2, ring.late_cast=1,ring.heads_first=1,streams=2,matvec.weights_first=0,"
                      f"pdl={flip},w13={w13},dense.prefetch={pre}, dense.block_n=32,slots.block_n=128,"
                      f"slots.late_cast={1 - slots.LAUNCH['late_cast']}")  # (not the defaults)
    assert (v.streams, v.pdl, v.w13) == (2, flip, w13)
    assert (v.ring, v.matvec) == (dict(rows_per_program=2, late_cast=True, heads_first=True), dict(weights_first=0))
    assert v.dense == dict(prefetch=pre, block_n=32)
    assert v.slots == dict(block_n=128, late_cast=1 - slots.LAUNCH["late_cast"])
    before = settings()
    with _applied(v):
        assert ring.LAUNCH == dict(before[0], rows_per_program=2, late_cast=True, heads_first=True)
        assert matvec.LAUNCH == dict(before[1], weights_first=0) and _pdl.ENABLED == flip
        assert decode.LAUNCH == dict(before[2], prefetch=pre, block_n=32) and gpt.MERGE_FFN == bool(w13)
        assert slots.LAUNCH == dict(before[5], **v.slots)
        assert _pdl.pdl_args(torch.device("cpu")) == dict(PDL=False, launch_pdl=False)  # (only on CUDA)
    assert settings() == before
    for spec, msg in (("streams=3", "streams must be 1 or 2"), ("pdl=2", "pdl, w13 0 or 1"),
                      ("w13=5", "pdl, w13 0 or 1"), ("dense_dot=1", "unknown variant setting 'dense_dot=1'"),
                      ("dense.block_n=48", "block_n=48 is invalid"), ("dense.dot=x", "dense variant settings take integers"),
                      ("warps=2", "unknown variant setting 'warps=2'"),
                      ("ring.num_warps=3", "num_warps=3 is invalid"), ("matvec.weights_first=x", "take integers"),
                      ("slots.block_n=20", "block_n=20 is invalid"), ("slots.late_cast=3", "0 or 1"),
                      ("streams", "KEY=VALUE pairs")):
        with pytest.raises(ValueError, match=msg):
            parse_variant(spec)
    row = dict(policy="diagonal", kernel="triton", batch=256, max_batch=False, ms_per_step=4.0, floor_ms_per_step=1.4,
               ratio_to_floor=2.9, images_per_s=110.0, x_dense_same_batch=2.5, x_dense_max_batch=None,
               tokens_per_s=6e4, peak_mem_gb=9.6, kv_bytes_per_image=3e7, kv_read_bytes_per_step=4e9, variant=v.label)
    assert f"| diagonal [{v.label}] | triton | 256 |" in markdown_table(dict(rows=[row]))


@pytest.mark.parametrize("spec", ["diagonal", "diagonal:sinks=0,local=3", "streaming:recent=9,sinks=2"])
def test_offset_budget_read_is_the_mean_read_set(spec):
    """Budget.read (counted from the offsets table) == the mean length of read_positions over decode queries."""
    name, _, args = spec.partition(":")
    pol = policies.get(name, **policies.parse_args([a for a in args.split(",") if a]))
    lay = Layout(3, 7, 9)
    want = [len(pol.read_positions(lay, q)) for q in range(3, 3 + lay.image_tokens - 1)]
    assert pol.budget(lay).read == pytest.approx(sum(want) / len(want), rel=1e-12)


@pytest.mark.parametrize("name", ["h2o:rho=0.4", "tova:rho=0.4", "headkv:rho=0.7", "lines:rho=0.9"])
def test_scored_cache_bookkeeping_traced_equals_eager(name):
    """SlotKVCache.fuse (what the engine's compile mode does): traced by dynamo, same logits and same kept set."""
    from functools import partial

    gpt = random_gpt("c2i", seed=12, n_kv_head=2)
    pname, _, arg = name.partition(":")
    pol = policies.get(pname, **policies.parse_args([arg])).prepare(gpt)
    cond = random_cond(gpt, 2, seed=3)
    tokens = torch.randint(0, gpt.config.vocab_size, (2, gpt.config.image_tokens), generator=torch.Generator().manual_seed(4))
    outs = []
    for fuse in (False, True):
        run = _Runner(gpt, _Plan(2, False, 0, False), torch.device("cpu"), False, policy=pol)
        if fuse:
            run.cache.fuse(partial(torch.compile, backend="eager", dynamic=False))
        with torch.no_grad():
            logits = [run.prefill_logits(cond)]
            for t in range(1, tokens.shape[1]):
                run.cur.copy_(tokens[:, t - 1])
                logits.append(run.step_logits())
        outs.append((torch.stack(logits, 1), run.cache.spos.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[1][1], outs[0][1])


def test_scored_cache_bookkeeping_compiles_once_across_a_graph_break(monkeypatch):
    """An eviction that breaks the compiled graph (HeadKV's Triton kernels on CUDA) compiles the
    bookkeeping a fixed number of times, not once per decode step (which had hit dynamo's
    recompile limit and left the bookkeeping eager: dozens of small kernels a layer). torch 2.11
    (the GPU image's) recompiled every step while a bound ``spos.masked_fill_`` was held across the
    break; 2.13 does not, so this can fail only on the older torch (run there by docs/bench/next-gpu-run.sh a)."""
    from functools import partial

    from arsparse.policies.headwise import HeadKVPolicy

    def breaking_evict(self, *args):
        torch._dynamo.graph_break()
        return real_evict(self, *args)

    real_evict = HeadKVPolicy.evict
    monkeypatch.setattr(HeadKVPolicy, "evict", breaking_evict)
    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo compiles
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    gpt = random_gpt("c2i", seed=int(torch.randint(0, 2**31, ())), n_kv_head=2)
    pol = policies.get("headkv", rho=0.7).prepare(gpt)
    run = _Runner(gpt, _Plan(2, False, 0, False), torch.device("cpu"), False, policy=pol)
    run.cache.fuse(partial(torch.compile, backend=backend, dynamic=False))
    counts = []
    with torch.no_grad():
        run.prefill_logits(random_cond(gpt, 2, seed=3))
        for t in range(12):
            run.cur.fill_(t % gpt.config.vocab_size)
            run.step_logits()
            counts.append(len(graphs))
    torch._dynamo.reset()
    assert counts[0] > 0 and counts[-1] == counts[1], counts


def test_scored_cache_write_compiled_in_place():
    """The slot write as the engine compiles it (inductor): the new token lands in each (row, kv head)'s
    first free slot, and the generated code never loops over the whole K/V cache (a scatter_ there had
    made inductor copy the cache and back every layer, every step)."""
    from torch._inductor.utils import run_and_get_code

    gpt = random_gpt("c2i", seed=5, n_kv_head=2)
    cfg = gpt.config
    cache = policies.get("h2o", rho=0.5).prepare(gpt).make_cache(cfg, 3, torch.float32, "cpu")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    kc, vc, spos, score = cache.k[1], cache.v[1], cache.spos[1], cache.score[1]  # (B, Hkv, C, D), (B, Hkv, C)
    B, Hkv, C, D = kc.shape
    kc.copy_(torch.randn(kc.shape, generator=g))
    vc.copy_(torch.randn(vc.shape, generator=g))
    score.copy_(torch.rand(score.shape, generator=g))
    spos.copy_(torch.randint(0, 50, spos.shape, generator=g))
    free = torch.rand(spos.shape, generator=g) < 0.4
    free[..., -1] = True  # (there is always a free slot)
    spos.masked_fill_(free, -1)
    cache.pos.fill_(60)
    k, v = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
    want = [t.clone() for t in (kc, vc, spos, score)]
    for b in range(B):
        for h in range(Hkv):
            s = int(free[b, h].nonzero()[0])
            want[0][b, h, s], want[1][b, h, s], want[2][b, h, s], want[3][b, h, s] = k[b, h, 0], v[b, h, 0], 60, 0.0
    _, code = run_and_get_code(torch.compile(cache._write, dynamic=False), kc, vc, spos, score, k, v)
    for got, ref in zip((kc, vc, spos, score), want):
        assert torch.equal(got, ref)
    assert code and not any(f"{kc.numel()}L" in c for c in code), "the compiled write copies the whole cache"


def test_adaptive_calibration_size_is_capped():
    """Calibration decodes its conditions at once (in the server, inside the request), so their number is bounded."""
    n = int(torch.randint(65, 10_000, ()))
    with pytest.raises(policies.PolicyError, match=rf"calib_samples must be an integer in \[1, 64\].*got {n}"):
        policies.get("diagonal-adaptive", calib_samples=n)
    assert policies.get("diagonal-adaptive", calib_samples=64).calib_samples == 64


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_scored_teacher_forcing_refuses_mismatched_batches_and_bad_tokens(name):
    """The token-by-token path would broadcast one row of conditions or tokens over the other (2 conditions,
    1 token row: two rows of logits, silently): both sizes are named instead; so are the column and id ranges."""
    gpt = random_gpt("c2i", image_tokens=16)
    pol = policies.get(name, rho=0.9)
    cond, tokens = random_cond(gpt, 2), torch.randint(0, 48, (2, 5))
    with pytest.raises(ValueError, match="2 conditions for 1 token rows"):
        gpt.logits(cond, tokens[:1], policy=pol)
    with pytest.raises(ValueError, match="1 conditions for 2 token rows"):
        gpt.logits(cond[:1], tokens, policy=pol)
    with pytest.raises(ValueError, match="2 conditions for 1 token rows"):  # the policy's own entry point
        pol.teacher_forced_logits(gpt, cond, tokens[:1])
    with pytest.raises(ValueError, match=r"1..16 columns .*got 17"):
        pol.teacher_forced_logits(gpt, cond, torch.randint(0, 48, (2, 17)))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 48\).*got 48"):
        pol.teacher_forced_logits(gpt, cond, torch.full((2, 5), 48))
    assert gpt.logits(cond, tokens, policy=pol).shape == (2, 5, 48)


def test_evaluations_own_decode_loop_refuses_what_teacher_forcing_refuses():
    from arsparse.eval.forcing import forced_logits

    gpt = random_gpt("c2i", image_tokens=16)
    pol, cond = policies.get("h2o", rho=0.9), random_cond(gpt, 2)
    for tokens, msg in [(torch.zeros(1, 4, dtype=torch.long), "2 conditions for 1 token rows"),
                        (torch.full((2, 4), 48), r"token ids must be in \[0, 48\).*got 48"),
                        (torch.zeros(2, 17, dtype=torch.long), "1..16 columns .*got 17")]:
        with pytest.raises(ValueError, match=msg):
            forced_logits(gpt, cond, tokens, pol, graphs=False)


def test_a_calibrated_guidance_holds_for_its_policy_at_the_default_settings_alone():
    """bundles.policy_guidance: the policy's own scale when its arguments leave it as `get(name)` makes it
    (none, or the defaults spelled out), the default scale for any other setting or another policy."""
    from arsparse.bundles import BUNDLES, policy_guidance

    g, default = (float(x) for x in 1 + 4 * torch.rand(2))
    defaults = policies.get("diagonal").params()
    scales = {"diagonal": g}
    assert policy_guidance(scales, default, "diagonal") == g
    assert policy_guidance(scales, default, "diagonal", {"rows": defaults["rows"], "band": defaults["band"]}) == g
    assert policy_guidance(scales, default, "diagonal", {"rows": defaults["rows"] + 1}) == default
    assert policy_guidance(scales, default, "streaming") == default
    with pytest.raises(policies.PolicyError, match="unknown parameter"):
        policy_guidance(scales, default, "diagonal", {"wide": 2})
    fashion = BUNDLES["fashion-c2i"]
    assert fashion.guidance("dense") == fashion.cfg_scale and fashion.guidance("diagonal") != fashion.cfg_scale
