"""Attention analysis: metrics on attention of known structure, capture against attention computed by
hand from the weights, hooks that leave no trace, and the `analyze` command end to end."""
import argparse
import json
import math
import os

import pytest
import torch

import arsparse.policies as policies
from arsparse.analysis import (CATEGORIES, AttentionCapture, AttentionStats, MetricConfig, ReadSet, capture_decode,
                               capture_teacher_forced, summarize_attention)
from arsparse.analysis.cli import parse_steps
from arsparse.analysis.metrics import key_categories
from arsparse.engine.cache import DenseKVCache
from arsparse.engine.generator import Generator
from arsparse.layout import Layout
from arsparse.models.rope import apply_rope
from conftest import random_cond, random_gpt


def _random_attention(T: int, H: int, seed: int, B: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, T, T, generator=g, dtype=torch.float64) * 2
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return s.masked_fill(~causal, float("-inf")).softmax(-1)


def _seed() -> int:
    """A fresh seed per call (printed, so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little") % (2**31 - 1)
    print(f"seed={seed}")
    return seed


# -- metrics on synthetic attention --------------------------------------------------------------


@pytest.mark.parametrize("k,delta", [(1, 0), (2, 1), (1, -2)])
def test_all_mass_on_one_diagonal_lands_in_its_band_cell(k, delta):
    g = torch.Generator().manual_seed(_seed())
    P, gh, gw, extra = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((0, 4), (4, 8), (5, 9), (0, 3)))
    lay = Layout(prefix_len=P, grid_h=gh, grid_w=gw, row_stride=gw + extra)  # maybe end-of-line tokens
    cfg = MetricConfig(sinks=0, local=2, band_rows=3, band_width=2)
    T = lay.prefix_len + lay.image_tokens - 1
    W = lay.row_stride
    stats = AttentionStats(lay, 1, 3, config=cfg)
    qpos = torch.tensor([q for q in range(T) if lay.prefix_len <= q - k * W + delta <= q])
    w = torch.zeros(2, 3, len(qpos), T)
    w[:, :, torch.arange(len(qpos)), qpos - k * W + delta] = 1.0
    stats.add("x", 0, qpos, w)
    ph = stats.summary()["phases"]["x"]
    band = torch.tensor(ph["bands"]["overall"])
    assert band[k - 1, delta + cfg.band_width] == pytest.approx(1.0)
    assert band.sum() == pytest.approx(1.0)
    assert ph["mass"]["bands"]["overall"] == pytest.approx(1.0)
    for c in ("prompt", "sinks", "local", "rest"):
        assert ph["mass"][c]["overall"] == pytest.approx(0.0, abs=1e-12)
    prof = ph["offset_profile"]["overall"]
    assert max(range(len(prof)), key=lambda o: prof[o] or 0) == k * W - delta
    assert ph["coverage"]["keys"]["overall"] == [1.0, 1.0, 1.0]
    assert ph["heads"]["local_class"] == [["local"] * 3]
    assert ph["heads"]["position_share"][0] == pytest.approx([1.0] * 3)


def test_uniform_attention_needs_ceil_p_times_keys():
    lay = Layout(prefix_len=1, grid_h=7, grid_w=9)
    T = lay.prefix_len + lay.image_tokens - 1
    causal = torch.ones(T, T).tril()
    att = (causal / causal.sum(-1, keepdim=True))[None].expand(2, T, T)
    budgets = [1, 5, 17, 40]
    s = summarize_attention(att, lay, MetricConfig(coverage=(0.9, 0.95, 0.99, 0.5)), oracle_budgets=budgets)
    ph = s["phases"]["attention"]
    qs = range(lay.prefix_len, T)
    for j, p in enumerate((0.9, 0.95, 0.99, 0.5)):
        want = sum(math.ceil(p * (q + 1)) for q in qs) / len(qs)
        assert ph["coverage"]["keys"]["overall"][j] == pytest.approx(want, abs=2e-6)
        for r in range(lay.grid_h):
            rq = [q for q in qs if (q - lay.prefix_len) // lay.row_stride == r]
            assert ph["coverage"]["keys"]["by_row"][r][j] == pytest.approx(
                sum(math.ceil(p * (q + 1)) for q in rq) / len(rq), rel=1e-6)
    for j, b in enumerate(budgets):
        want = sum(min(b, q + 1) / (q + 1) for q in qs) / len(qs)
        assert ph["oracle"]["overall"][j] == pytest.approx(want, abs=2e-6)


def test_categories_partition_keys_as_defined():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    P, gh, gw, extra = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((0, 4), (3, 7), (3, 9), (0, 3)))
    lay = Layout(P, gh, gw, gw + extra)
    W = lay.row_stride
    cfg = MetricConfig(sinks=int(torch.randint(0, 4, (1,), generator=g)), local=int(torch.randint(1, 6, (1,), generator=g)),
                       band_rows=2, band_width=(W - 1) // 2).fit(lay)
    T = P + lay.image_tokens - 1
    qpos = torch.arange(P, T)
    cat = key_categories(lay, cfg, qpos, T)
    for i, q in enumerate(qpos.tolist()):
        for key in range(T):
            o = q - key
            if o < 0:
                want = len(CATEGORIES)
            elif key < P:
                want = 0
            elif key < P + cfg.sinks:
                want = 1
            elif o < cfg.local:
                want = 2
            elif any(key == q - k * W + d for k in range(1, cfg.band_rows + 1)
                     for d in range(-cfg.band_width, cfg.band_width + 1)):
                want = 3
            else:
                want = 4
            assert int(cat[i, key]) == want, (seed, q, key)
    # and the masses of random attention add up to one per query
    att = _random_attention(T, 2, seed)
    ph = summarize_attention(att, lay, cfg)["phases"]["attention"]
    assert sum(ph["mass"][c]["overall"] for c in CATEGORIES) == pytest.approx(1.0, abs=1e-6)


class _SelfOnly:
    """A policy that reads only the query itself."""

    def read_positions(self, layout, q, layer=0, head=0, n_layer=1, n_head=1):
        return [q]


def test_recall_of_dense_is_one_and_of_self_only_is_the_diagonal():
    seed = _seed()
    lay = Layout(prefix_len=2, grid_h=5, grid_w=6)
    T = lay.prefix_len + lay.image_tokens - 1
    att = _random_attention(T, 3, seed, B=2)
    diag = policies.get("diagonal", local=2, rows=1, band=1, sinks=1)
    sets = [ReadSet.from_policy("dense", policies.get("dense"), lay, 1, 3),
            ReadSet.from_policy("self", _SelfOnly(), lay, 1, 3),
            ReadSet.from_policy("diagonal", diag, lay, 1, 3)]
    ph = summarize_attention(att, lay, read_sets=sets)["phases"]["attention"]
    qs = torch.arange(lay.prefix_len, T)
    assert ph["recall"]["dense"]["overall"] == pytest.approx(1.0, abs=1e-6)
    want_self = att[:, :, qs, qs].mean(dim=(0, 2))  # (H,)
    assert ph["recall"]["self"]["per_head"][0] == pytest.approx(want_self.tolist(), abs=1e-6)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        mask[q, diag.read_positions(lay, q)] = True
    want_diag = (att * mask)[:, :, qs].sum(-1).mean(dim=(0, 2))
    assert ph["recall"]["diagonal"]["per_head"][0] == pytest.approx(want_diag.tolist(), abs=1e-6)
    assert 0 < ph["recall"]["diagonal"]["overall"] < 1


@pytest.mark.parametrize("name,params", [("diagonal", dict(local=3, rows=2, band=1, sinks=2)),
                                         ("streaming", dict(sinks=1, recent=5))])
def test_offset_read_sets_equal_read_positions(name, params):
    lay = Layout(prefix_len=3, grid_h=5, grid_w=6, row_stride=7)
    pol = policies.get(name, **params)
    rs = ReadSet.from_policy(name, pol, lay, 2, 2, check=0)
    T = lay.prefix_len + lay.image_tokens - 1
    m = rs.mask(1, [0, 1], torch.arange(T), T)
    for q in range(lay.prefix_len, T):
        assert m[1, q].nonzero()[:, 0].tolist() == pol.read_positions(lay, q, 1, 1, 2, 2)


# -- capture against attention computed from the weights -------------------------------------------


def _reference_attention(gpt, cond, tokens):
    """Per layer, (B, H, T, T) causal attention from each block's wqkv, RoPE and softmax, by hand."""
    cfg = gpt.config
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
    h = torch.cat([gpt.embed_cond(cond), gpt.tok_embeddings(tokens[:, :-1])], dim=1)
    B, T, _ = h.shape
    rope = gpt.rope[:T]
    out = []
    for i, block in enumerate(gpt.layers):
        x = block.attention_norm(h)
        q, k, _ = block.attention.wqkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.view(B, T, H, D), rope).transpose(1, 2).double()
        k = apply_rope(k.view(B, T, Hkv, D), rope).transpose(1, 2).double().repeat_interleave(H // Hkv, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out.append(s.softmax(-1))
        h = block(h, rope, i, None)
    return out


@pytest.mark.parametrize("model_type,kv", [("c2i", None), ("t2i", 2)])
def test_captured_attention_equals_attention_from_the_weights(model_type, kv):
    seed = _seed()
    gpt = random_gpt(model_type, image_tokens=16, seed=seed, n_kv_head=kv)
    cfg = gpt.config
    B = 3
    cond = random_cond(gpt, B, seed=seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.image_tokens), generator=torch.Generator().manual_seed(seed))
    stats = AttentionStats(gpt.layout, cfg.n_layer, cfg.n_head, keep="all", keep_rows=B)
    with torch.no_grad(), AttentionCapture(gpt, stats) as cap:
        capture_teacher_forced(gpt, cap, cond, tokens, "prefill")
        ref = _reference_attention(gpt, cond, tokens)
    P, T = cfg.cls_token_num, cfg.cls_token_num + cfg.image_tokens - 1
    for li in range(cfg.n_layer):
        for h in range(cfg.n_head):
            got = stats.maps[("prefill", li, h)]
            assert torch.isnan(got[:, :P]).all()  # prompt queries are not recorded
            torch.testing.assert_close(got[:, P:], ref[li][:, h, P:T].float(), atol=2e-5, rtol=1e-4)


def test_decode_capture_equals_attention_over_the_generated_tokens():
    seed = _seed()
    gpt = random_gpt("c2i", image_tokens=16, seed=seed)
    cfg = gpt.config
    B = 2
    cond = random_cond(gpt, B, seed=seed + 1)
    gen = Generator(gpt, device="cpu", cuda_graphs=False)
    steps = [0, 3, 4, 9, 14]
    stats = AttentionStats(gpt.layout, cfg.n_layer, cfg.n_head, keep="all", keep_rows=B)
    with AttentionCapture(gpt, stats, steps=steps) as cap:
        tokens = capture_decode(gen, cap, cond, cfg_scale=3.0, seed=seed)
    P = cfg.cls_token_num
    with torch.no_grad():
        ref = _reference_attention(gpt, cond, tokens)
        ref_null = _reference_attention(gpt, gpt.null_cond(cond), tokens)
    rows = [P + i for i in steps]
    for li in range(cfg.n_layer):
        for h in range(cfg.n_head):
            for phase, r in (("decode", ref), ("decode-uncond", ref_null)):
                got = stats.maps[(phase, li, h)]
                torch.testing.assert_close(got[:, rows], r[li][:, h, rows].float(), atol=1e-4, rtol=1e-3)
                others = [q for q in range(got.shape[1]) if q not in rows]
                assert torch.isnan(got[:, others]).all()
    assert stats.summary()["phases"]["decode"]["queries"] == B * len(steps)


def test_hooks_leave_the_model_and_engine_unchanged_even_on_errors():
    seed = _seed()
    gpt = random_gpt("c2i", image_tokens=16, seed=seed)
    cfg = gpt.config
    cond = random_cond(gpt, 2, seed=seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.image_tokens), generator=torch.Generator().manual_seed(seed))
    state = {k: v.clone() for k, v in gpt.state_dict().items()}
    with torch.no_grad():
        before = gpt.logits(cond, tokens)
    stats = AttentionStats(gpt.layout, cfg.n_layer, cfg.n_head)
    with torch.no_grad(), AttentionCapture(gpt, stats) as cap:
        assert all(len(b.attention._forward_pre_hooks) == 1 for b in gpt.layers)
        with cap.phase("prefill"):
            during = gpt.logits(cond, tokens)
        outside = gpt.logits(cond, tokens)  # hooked but not recording
    assert torch.equal(during, before) and torch.equal(outside, before)
    assert stats.summary()["phases"]["prefill"]["queries"] == 2 * (cfg.image_tokens - 1)

    def boom(*_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        with AttentionCapture(gpt, callback=boom) as cap, cap.phase("prefill"):
            gpt.logits(cond, tokens)
    with pytest.raises(KeyError), AttentionCapture(gpt, stats):
        raise KeyError("inside")
    assert all(len(b.attention._forward_pre_hooks) == 0 for b in gpt.layers)
    with torch.no_grad():
        assert torch.equal(gpt.logits(cond, tokens), before)
    assert all(torch.equal(v, state[k]) for k, v in gpt.state_dict().items())

    # the engine: same samples with and without capture, and its dense cache untouched
    gen = Generator(gpt, device="cpu", cuda_graphs=False)
    plain = gen.sample_tokens(cond, cfg_scale=2.0, seed=seed)
    with pytest.raises(RuntimeError, match="boom"):
        with AttentionCapture(gpt, callback=boom) as cap:
            capture_decode(gen, cap, cond, cfg_scale=2.0, seed=seed)
    with AttentionCapture(gpt, AttentionStats(gpt.layout, cfg.n_layer, cfg.n_head)) as cap:
        captured = capture_decode(gen, cap, cond, cfg_scale=2.0, seed=seed)
    assert torch.equal(captured, plain)
    assert torch.equal(gen.sample_tokens(cond, cfg_scale=2.0, seed=seed), plain)
    assert type(gen._runner.cache) is DenseKVCache and "attend" not in vars(gen._runner.cache)
    assert all(len(b.attention._forward_pre_hooks) == 0 for b in gpt.layers)


def test_capture_refuses_what_it_cannot_measure():
    gpt = random_gpt("c2i", image_tokens=16, seed=0)
    cond = random_cond(gpt, 1)
    sparse = Generator(gpt, device="cpu", cuda_graphs=False, policy=policies.get("streaming", sinks=1, recent=4))
    with AttentionCapture(gpt) as cap, pytest.raises(ValueError, match="dense attention"):
        capture_decode(sparse, cap, cond, cfg_scale=1.0)
    with pytest.raises(ValueError, match="out of range"):
        AttentionCapture(gpt, steps=[15])


def test_parse_steps():
    assert parse_steps("all", 10) is None
    assert parse_steps("0:10:4,7,2-3", 10) == [0, 2, 3, 4, 7, 8]
    with pytest.raises(ValueError, match="out of range"):
        parse_steps("12", 10)


@pytest.mark.parametrize("name", ["fashion-c2i", "emoji-c2i"])
def test_held_out_tokens_are_the_requested_classes_held_out_images(name):
    """analyze's prefill on real images: for each requested class its next held-out image (a class asked
    twice gives its first and its second), tokenised as the tokenizer encodes the pixels itself."""
    import numpy as np

    import arsparse
    from arsparse.analysis.report import held_out_tokens
    from arsparse.bundles import BUNDLES
    from arsparse.data.emoji import EmojiDataError, load_emoji
    from arsparse.data.fashion import FashionDataError, load_fashion
    from arsparse.training.datasets import encode_images

    if not BUNDLES[name].available:
        pytest.skip(f"{name} weights not installed: {BUNDLES[name].how_to_get}")
    try:
        images, labels = load_fashion("test") if name == "fashion-c2i" else load_emoji("test")
    except (FashionDataError, EmojiDataError) as e:
        pytest.skip(f"{name}'s held-out data not installed: {e}")
    gpt, tok = arsparse.load_model(name)
    g = torch.Generator().manual_seed(_seed())
    classes = torch.randint(0, gpt.config.num_classes, (3,), generator=g).tolist()
    classes.append(classes[0])
    tokens, note = held_out_tokens(gpt, tok, classes, name)
    assert tokens is not None, note
    seen: dict[int, int] = {}
    expect = []
    for c in classes:
        expect.append(int(np.flatnonzero(labels.numpy() == c)[seen.get(c, 0)]))
        seen[c] = seen.get(c, 0) + 1
    assert f"images {expect}" in note
    if name == "fashion-c2i":  # (the palette's encode of the image in [-1, 1], not its byte table)
        ref = tok.encode(images[expect].float()[:, None] / 127.5 - 1.0)
        assert torch.equal(tokens, ref)
    else:  # (the VQ's codes of the pixels, in a batch of their own: near-ties may round differently)
        ref = encode_images(tok, images[expect])
        assert (tokens == ref).float().mean() > 0.99
    # a model of no known data set (random tiny weights, given by no bundle name): none, and why
    none, why = held_out_tokens(random_gpt(image_tokens=16, num_classes=3), None, [0, 1])
    assert none is None and "no held-out images" in why


# -- end to end -----------------------------------------------------------------------------------


def test_cmd_analyze_writes_report_stats_and_figures(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from arsparse.analysis.cli import add_analyze_parser
    from arsparse.bundles import BUNDLES, Bundle
    from arsparse.models.config import gpt_config
    from arsparse.models.vq import vq_config

    monkeypatch.setitem(BUNDLES, "tiny-test", Bundle(
        "tiny-test", "test only", gpt_config("GPT-tiny", image_tokens=36, vocab_size=64, num_classes=5),
        vq_config("VQ-16", ch=32, codebook_size=64, codebook_embed_dim=4), seed=_seed()))
    parser = argparse.ArgumentParser(prog="arsparse")
    add_analyze_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "an"
    args = parser.parse_args(["analyze", "--model", "tiny-test", "--out", str(out), "--num-images", "2",
                              "--decode-steps", "0:35:2", "--rho", "0.25,0.5", "--band-rows", "2", "--quiet"])
    assert args.func(args) == 0
    stats = json.loads((out / "stats.json").read_text())
    phases = stats["summary"]["phases"]
    assert {"prefill", "decode", "decode-uncond"} <= set(phases)
    for ph in phases.values():
        assert sum(ph["mass"][c]["overall"] for c in CATEGORIES) == pytest.approx(1.0, abs=1e-5)
        assert ph["queries"] == 2 * 18
        assert ph["recall"]["dense"]["overall"] == pytest.approx(1.0, abs=1e-5)
    assert stats["meta"]["prefill_source"] == "own samples"  # no real images for this model
    report = (out / "report.md").read_text()
    for section in ("## Where the mass goes", "## Policy recall", "## Head classes", "own samples"):
        assert section in report
    assert set(stats["figures"]) >= {"mass", "offsets", "bands", "coverage", "recall", "maps", "query"}
    for name in stats["figures"].values():
        assert f"]({name})" in report
        with Image.open(out / name) as im:
            im.verify()
            assert im.format == "PNG" and min(im.size) > 50
