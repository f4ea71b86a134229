"""Head-wise policies: HeadKV, SSD (``ssh``) and the calibrated per-head diagonal (``diagonal-adaptive``)."""
import itertools
import re

import pytest
import torch

from arsparse.engine.generator import Generator
from arsparse.layout import Layout
from arsparse.policies import PolicyError, get, names
from arsparse.policies.base import dense_entries
from arsparse.policies.calibration import (OffsetMassCapture, allocate, choose_offsets, classify, locality,
                                           offset_mass)
from arsparse.policies.headwise import DiagonalAdaptivePolicy, lowest_k, stratified_evict
from conftest import random_cond, random_gpt

HEAD_TYPED = ["headkv", "ssh"]


def _gen(gpt, policy):
    return Generator(gpt, device="cpu", dtype=torch.float32, cuda_graphs=False, compile=False, policy=policy)


def _tokens(gpt, batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, gpt.config.vocab_size, (batch, gpt.config.image_tokens), generator=g)


def _decode(gpt, policy, cond, tokens):
    """Step the policy's cache through ``tokens``; yield (image index of the query, cache) after each step."""
    cache = policy.make_cache(gpt.config, cond.shape[0], torch.float32, "cpu")
    P = gpt.config.cls_token_num
    with torch.no_grad():
        cache.phase = "prefill"
        gpt.forward_hidden(gpt.embed_cond(cond), torch.arange(P), cache)
        cache.pos.fill_(P)
        cache.phase = "decode"
        for i in range(tokens.shape[1] - 1):
            gpt.forward_hidden(gpt.tok_embeddings(tokens[:, i : i + 1]), cache.pos.view(1), cache)
            cache.pos.add_(1)
            yield i, cache


# -- registry and parameters ---------------------------------------------------------------------


def test_registered_with_sources():
    for name in ("headkv", "ssh", "diagonal-adaptive"):
        assert name in names()
        p = get(name)
        d = p.describe()
        assert d["name"] == name and d["source"] and d["doc"]
        assert p.kind == ("offset" if name == "diagonal-adaptive" else "scored")
        hash(p)  # frozen dataclass


@pytest.mark.parametrize("name, params, match", [
    ("headkv", dict(rho=0), r"rho .* must be in \(0, 1\]"),
    ("headkv", dict(rho=1.5), r"rho .* must be in \(0, 1\]"),
    ("headkv", dict(threshold=1.0), r"threshold .* in \(0, 1\)"),
    ("headkv", dict(threshold=-0.2), r"threshold .* in \(0, 1\)"),
    ("headkv", dict(calib_rows=1), r"calib_rows .* integer >= 2"),
    ("headkv", dict(recent=0), r"recent .* integer >= 1"),
    ("headkv", dict(large_max=0.5), r"large_max .* in \[1, inf\)"),
    ("headkv", dict(small=0.0), r"small .* in \(0, 1\]"),
    ("headkv", dict(small=1.5), r"small .* in \(0, 1\]"),
    ("headkv", dict(band=2), r"unknown parameter.*'band'.*allowed: \['rho', 'calib_rows'"),
    ("ssh", dict(spatial_window=0), r"spatial_window .* integer >= 1"),
    ("ssh", dict(threshold="high"), r"threshold .* got 'high'"),
    ("ssh", dict(window=3), r"unknown parameter.*allowed: .*'spatial_window'"),
    ("diagonal-adaptive", dict(rho=-0.1), r"rho .* must be in \(0, 1\]"),
    ("diagonal-adaptive", dict(read=0), r"read .* in \(0, 1\]"),
    ("diagonal-adaptive", dict(local=0), r"local .* integer >= 1"),
    ("diagonal-adaptive", dict(calib_samples=0), r"calib_samples .* integer in \[1, 64\]"),
    ("diagonal-adaptive", dict(calib_samples=65), r"calib_samples .* integer in \[1, 64\].*got 65"),
    ("diagonal-adaptive", dict(calib_rows=-1), r"calib_rows .* integer >= 1"),
    ("diagonal-adaptive", dict(temperature=-1.0), r"temperature .* in \[0, inf\)"),
    ("diagonal-adaptive", dict(table=((0, 1),)), r"table must be a tuple \(layers\) of tuples \(heads\)"),
    ("diagonal-adaptive", dict(table=(((0, 1, 5),),)), r"table\[0\]\[0\] lacks offsets 0..3"),
])
def test_bad_params_name_what_is_allowed(name, params, match):
    with pytest.raises(PolicyError, match=match):
        get(name, **params)


def test_unknown_name_lists_the_policies():
    with pytest.raises(PolicyError, match=r"unknown policy 'head-kv'; choose one of .*headkv.*ssh.*diagonal-adaptive"):
        get("head-kv")


def test_params_that_do_not_fit_the_layout():
    lay = Layout(1, 6, 6)  # dense 36 entries
    with pytest.raises(PolicyError, match=r"calib_rows=6 must leave rows .*at most 5"):
        get("headkv", rho=0.5, calib_rows=6, recent=2).check(lay)
    with pytest.raises(PolicyError, match=r"keeps 3 image entries, fewer than the 7"):  # the query and a row
        get("headkv", rho=0.125).check(lay)
    with pytest.raises(PolicyError, match=r"keeps 3 image entries, fewer than the 5"):
        get("headkv", rho=0.125, recent=5).check(lay)
    with pytest.raises(PolicyError, match=r"spatial_window=3 rows \(18 entries\) exceed the uniform capacity 9 .* rho >= 0.528"):
        get("ssh", rho=0.3, spatial_window=3).check(lay)
    with pytest.raises(PolicyError, match=r"recent=8 must fit in the spatial window \(6 entries\)"):
        get("ssh", rho=0.5, recent=8).check(lay)
    with pytest.raises(PolicyError, match=r"window of 3 positions .* fewer than local=4 .*needs rho >= 0.139"):
        get("diagonal-adaptive", rho=0.125).check(lay)


# -- calibration pieces --------------------------------------------------------------------------


def test_locality_scores_neighbourhood_uniform_and_far_attention():
    lay = Layout(1, 6, 6)
    q = torch.tensor(20)
    pos = torch.arange(1, 21)[torch.randperm(20)]  # every image position so far, in shuffled slots
    pos = torch.cat([pos, torch.full((3,), -1)]).expand(1, 3, -1)  # (1, 3, 23): three free slots
    near = (pos >= 0) & (q - pos <= lay.row_stride)
    w = torch.rand(1, 3, 23)
    w = torch.stack([w[0, 0] * near[0, 0], (pos[0, 1] >= 0).float(), w[0, 2] * (~near[0, 2] & (pos[0, 2] >= 0))])[None]
    w = 0.7 * w / w.sum(-1, keepdim=True)  # 30% on the prompt, which locality ignores
    val, ok = locality(w, pos, q, lay)
    torch.testing.assert_close(val, torch.tensor([[1.0, 0.0, -7 / 13]]))  # uniform: 7 of 20 entries are near
    assert ok.all()
    # In the first row everything is the neighbourhood: not measurable.
    pos0 = torch.tensor([[[1, 2, 3, -1]]])
    val0, ok0 = locality(torch.rand(1, 1, 4), pos0, torch.tensor(3), lay)
    assert not ok0.any() and (val0 == 0).all()


def test_classify_threshold():
    total = torch.tensor([[3.0, 2.9, 0.0, 6.0]])
    count = torch.tensor([[5.0, 5.0, 0.0, 6.0]])
    assert classify(total, count, 0.59).tolist() == [[True, False, False, True]]


def _allocate_reference(is_local, u, s, l):
    n = len(is_local)
    a = sum(is_local)
    b = n - a
    if a == 0 or b == 0:
        return [u] * n
    broad = min(n * u - a * s, b * l)
    loc = n * u - broad
    out, ia, ib = [], 0, 0
    for x in is_local:
        if x:
            out.append(loc // a + (ia < loc % a)); ia += 1
        else:
            out.append(broad // b + (ib < broad % b)); ib += 1
    return out


def test_allocate_keeps_the_uniform_total():
    g = torch.Generator().manual_seed(11)
    for _ in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        u = int(torch.randint(4, 40, (1,), generator=g))
        s = int(torch.randint(1, u + 1, (1,), generator=g))
        l = int(torch.randint(u, 3 * u, (1,), generator=g))
        is_local = torch.rand(5, n, generator=g) < 0.5
        cap = allocate(is_local, u, s, l)
        assert (cap.sum(-1) == n * u).all()
        assert (cap <= l).all() and (cap[is_local] <= u).all() and (cap[~is_local] >= u).all()
        for row, c in zip(is_local.tolist(), cap.tolist()):
            assert c == _allocate_reference(row, u, s, l)


def test_head_typing_on_synthetic_attention():
    """The hook alone, fed hand-made attention: a previous-token head and an above-token head are local,
    a head on the first image token and a uniform head are broad; capacities switch at the last
    calibration query and keep the uniform total."""
    lay = Layout(1, 6, 6)
    pol = get("headkv", rho=0.6, calib_rows=3, recent=2, small=0.5, threshold=0.5)
    u, s = pol.capacity(lay), pol.small_capacity(lay)
    C = pol.max_capacity(lay, 1, 4) + 1
    stats = {k: v[0] for k, v in pol.head_stats(1, 2, 4, "cpu").items()}  # 2 sequences, 4 heads
    cap = torch.full((2, 4), u)
    g = torch.Generator().manual_seed(3)
    n = pol.calib_queries(lay)
    for i in range(n + 2):
        q = torch.tensor(1 + i)
        held = torch.arange(max(1, 1 + i - u), 2 + i)  # the most recent entries, as a cache holds them
        pos = torch.full((2, 4, C), -1)
        for b, h in itertools.product(range(2), range(4)):
            pos[b, h, torch.randperm(C, generator=g)[: len(held)]] = held
        w = torch.rand(2, 4, C, generator=g) * 0.01 * (pos >= 0)
        target = [q - 1, q - lay.row_stride, torch.tensor(1), None]
        for h, t in enumerate(target):
            if t is not None:
                w[:, h] += 0.8 * (pos[:, h] == t)  # (a target that is not held yet adds nothing)
            else:
                w[:, h] = (pos[:, h] >= 0).float()
        w = 0.9 * w / w.sum(-1, keepdim=True)
        new = pol.update_capacity(cap, stats, w, pos, q, lay)
        if i < n - 1:
            assert (new == u).all(), i
        cap = new
    assert stats["is_local"].tolist() == [[True, True, False, False]] * 2
    assert (cap.sum(-1) == 4 * u).all()
    assert cap[:, :2].tolist() == [[s, s]] * 2 and (cap[:, 2:] == (4 * u - 2 * s) // 2).all()


def test_stratified_eviction_takes_from_the_fullest_row():
    lay = Layout(1, 6, 4)  # rows of 4
    P = 1
    # row 0: 3 entries, row 1: 4 entries (fullest), row 2: 2 entries, row 3: the protected query.
    pos = torch.tensor([P + 0, P + 1, P + 2, P + 4, P + 5, P + 6, P + 7, P + 8, P + 10, P + 12, -1])
    score = torch.tensor([0.5, 0.6, 0.7, 0.9, 0.4, 0.8, 0.45, 0.05, 0.06, 5.0, 0.0])
    evictable = pos >= 0
    evictable[9] = False  # the query itself
    k1 = torch.ones(1, 1, 1, dtype=torch.long)
    free = stratified_evict(score[None, None], pos[None, None], evictable[None, None], k1, lay)[0, 0]
    assert free.tolist() == [i == 4 for i in range(11)]  # row 1's weakest, not the global minimum (row 2)
    # H2O's rule would have taken the global minimum:
    assert lowest_k(score[None, None], evictable[None, None], k1)[0, 0].nonzero().item() == 7
    # Protected entries count towards a row's size. Row 2 now holds 4 (two of them protected), tying
    # with row 1: the weaker candidate of the two rows goes first (row 2's 0.05), then row 1's.
    pos2 = torch.tensor([P + 0, P + 1, P + 2, P + 4, P + 5, P + 6, P + 7, P + 8, P + 9, P + 10, P + 11, P + 12])
    score2 = torch.tensor([0.5, 0.6, 0.7, 0.9, 0.4, 0.8, 0.45, 0.05, 9.0, 0.06, 9.0, 5.0])
    ev2 = torch.ones(12, dtype=torch.bool)
    ev2[[8, 10, 11]] = False
    for k, want in [(1, [7]), (2, [4, 7]), (3, [4, 7, 9])]:
        free2 = get("headkv").evict(score2[None, None], pos2[None, None], ev2[None, None],
                                    torch.full((1, 1, 1), k), {}, lay)[0, 0]  # HeadKV's own rule
        assert free2.nonzero().flatten().tolist() == want


def _greedy_stratified(score, pos, evictable, k, lay):
    held = [i for i in range(len(pos)) if pos[i] >= 0]
    ev = set(i for i in held if evictable[i])
    kept = set(held)
    out = []
    for _ in range(k):
        cand = [i for i in ev if i in kept]
        if not cand:
            break
        row = lambda i: (pos[i] - lay.prefix_len) // lay.row_stride  # noqa: E731
        count = {}
        for i in kept:
            count[row(i)] = count.get(row(i), 0) + 1
        best = max(count[row(i)] for i in cand)
        victim = min((i for i in cand if count[row(i)] == best), key=lambda i: score[i])
        kept.discard(victim)
        out.append(victim)
    return sorted(out)


def test_stratified_eviction_equals_greedy_rounds():
    lay = Layout(2, 5, 5)
    g = torch.Generator().manual_seed(5)
    for _ in range(40):
        C = 16
        pos = torch.randperm(23, generator=g)[:C] + 2
        pos[torch.rand(C, generator=g) < 0.2] = -1
        score = torch.rand(C, generator=g)
        evictable = (pos >= 0) & (torch.rand(C, generator=g) < 0.8)
        k = int(torch.randint(0, 6, (1,), generator=g))
        free = stratified_evict(score[None, None], pos[None, None], evictable[None, None],
                                torch.full((1, 1, 1), k), lay)[0, 0]
        want = _greedy_stratified(score.tolist(), pos.tolist(), evictable.tolist(), k, lay)
        assert free.nonzero().flatten().tolist() == want


# -- the scored head-wise policies in the model --------------------------------------------------


@pytest.mark.parametrize("name", HEAD_TYPED)
@pytest.mark.parametrize("n_kv", [None, 2])
def test_capacities_hold_at_every_step_and_keep_the_uniform_total(name, n_kv):
    gpt = random_gpt("c2i", image_tokens=36, n_kv_head=n_kv, seed=7)
    lay, cfg = gpt.layout, gpt.config
    pol = get(name, rho=0.5, calib_rows=2, recent=2)
    u, Hkv = pol.capacity(lay), cfg.kv_heads
    large, n_cal = pol.large_capacity(lay), pol.calib_queries(lay)
    cond, tokens = random_cond(gpt, 4, seed=8), _tokens(gpt, 4, seed=9)
    assert pol.budget(lay).kept == lay.prefix_len + large  # the padded table, reported
    types = set()
    for i, cache in _decode(gpt, pol, cond, tokens):
        assert cache.spos.shape[-1] == large + 1
        kept, cap = cache.kept(), cache.head_cap  # (L, B, Hkv)
        assert (kept <= cap).all(), i
        assert (cap <= large).all()
        if i < n_cal - 1:
            assert (cap == u).all()
        else:
            assert (cap.sum(-1) == Hkv * u).all()
            is_local = cache.stats["is_local"]
            assert (cap[is_local] <= u).all() and (cap[~is_local] >= u).all()
            types.update(is_local.flatten().tolist())
            want = allocate(is_local, u, pol.small_capacity(lay), large)
            assert torch.equal(cap, want)  # the cache applies what the policy allocates
        q = lay.prefix_len + i
        if name == "ssh" and i >= n_cal - 1:
            # spatial heads hold exactly their capacity's most recent entries
            for li, b, h in zip(*cache.stats["is_local"].nonzero(as_tuple=True)):
                held = sorted(p for p in cache.spos[li, b, h].tolist() if p >= 0)
                assert held == list(range(q - int(cap[li, b, h]) + 1, q + 1))
        for p in range(max(lay.prefix_len, q - pol.recent + 1), q + 1):  # the protected recent window stays
            assert ((cache.spos == p).any(-1)).all()
    assert types == {True, False}  # this model's heads come out mixed: the per-head path is exercised
    assert cache.nbytes() > 0


@pytest.mark.parametrize("name", HEAD_TYPED)
def test_rho_one_is_dense(model_type, name):
    gpt = random_gpt(model_type, image_tokens=36, seed=2)
    cond, tokens = random_cond(gpt, 2, seed=3), _tokens(gpt, 2, seed=4)
    pol = get(name, rho=1.0, calib_rows=2, recent=2)
    with torch.no_grad():
        dense = gpt.logits(cond, tokens)
        got = gpt.logits(cond, tokens, policy=pol)
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=1e-4)
    assert dense.std() > 0.5


@pytest.mark.parametrize("name", HEAD_TYPED)
def test_sparse_differs_and_sampling_runs_with_guidance(name):
    gpt = random_gpt("c2i", image_tokens=36, seed=12)
    cond, tokens = random_cond(gpt, 2, seed=13), _tokens(gpt, 2, seed=14)
    pol = get(name, rho=0.4, calib_rows=2, recent=2)
    gen = _gen(gpt, pol)
    with torch.no_grad():
        dense = gpt.logits(cond, tokens)
        got = gen.cached_logits(cond, tokens)
    # Column c is predicted by the query at image index c - 1; nothing is evicted before the query at
    # index min(capacity, end of calibration) has attended.
    n = min(pol.capacity(gpt.layout), pol.calib_queries(gpt.layout) - 1) + 2
    torch.testing.assert_close(got[:, :n], dense[:, :n], atol=1e-4, rtol=1e-4)
    assert (got - dense).abs().max() > 1e-3  # it does evict
    toks = gen.sample_tokens(cond, cfg_scale=3.0, seed=1)
    assert toks.shape == (2, 36) and toks.min() >= 0 and toks.max() < gpt.config.vocab_size
    assert gen.sample_tokens(cond, cfg_scale=3.0, seed=1).equal(toks)  # the cache resets per call


class _Recorder:
    """Attention backend that runs ``cache`` and keeps every call's inputs and output."""

    def __init__(self, cache):
        self.cache, self.calls = cache, []

    def attend(self, layer, q, k, v):
        out = self.cache.attend(layer, q, k, v)
        self.calls.append((layer, q, k, v, out))
        return out


@pytest.mark.parametrize("n_kv", [None, 2])
def test_headkv_keeps_what_a_direct_recomputation_keeps(n_kv):
    """HeadKV with its defaults, against a plain recomputation from the model's own queries and keys.

    Per (layer, sequence, kv head) the reference holds a dict position -> (key, value, score): each
    step it adds the new token, attends each query head of the group over the prompt and the held
    entries (checking the cache's output, which also checks that slots hold their positions' K/V),
    adds the weights to the scores, then evicts down to the head's capacity, one greedy round at a
    time, never the query's neighbourhood (the query and the ``row_stride`` positions before it,
    so the token above the next prediction stays). The capacities are the cache's own (their
    typing is checked in test_capacities_hold_at_every_step_and_keep_the_uniform_total). A row
    wider than 8 makes the old default (8 protected positions) evict the previous row's newest
    entries, the token above the next prediction among them.
    """
    gpt = random_gpt("c2i", grid_h=5, grid_w=10, n_kv_head=n_kv, seed=20)
    lay, cfg = gpt.layout, gpt.config
    pol = get("headkv", rho=0.6)
    P, W, B, G, D = lay.prefix_len, lay.row_stride, 2, cfg.n_head // cfg.kv_heads, cfg.head_dim
    cond, tokens = random_cond(gpt, B, seed=22), _tokens(gpt, B, seed=23)
    cache = pol.make_cache(cfg, B, torch.float32, "cpu")
    rec = _Recorder(cache)
    heads = list(itertools.product(range(cfg.n_layer), range(B), range(cfg.kv_heads)))
    with torch.no_grad():
        cache.phase = "prefill"
        gpt.forward_hidden(gpt.embed_cond(cond), torch.arange(P), rec)
        prompt = {(li, b, g): (k[b, g].double(), v[b, g].double()) for li, _, k, v, _ in rec.calls
                  for b in range(B) for g in range(cfg.kv_heads)}
        held = {key: {} for key in heads}  # position -> [key, value, score]
        cache.pos.fill_(P)
        cache.phase = "decode"
        evicted = 0
        for i in range(lay.image_tokens - 1):
            q = P + i
            rec.calls.clear()
            gpt.forward_hidden(gpt.tok_embeddings(tokens[:, i : i + 1]), cache.pos.view(1), rec)
            cache.pos.add_(1)
            for li, qq, k, v, out in rec.calls:
                for b, g in itertools.product(range(B), range(cfg.kv_heads)):
                    entries = held[li, b, g]
                    entries[q] = [k[b, g, 0].double(), v[b, g, 0].double(), 0.0]
                    order = sorted(entries)
                    pk, pv = prompt[li, b, g]
                    keys = torch.cat([pk, torch.stack([entries[p][0] for p in order])])
                    values = torch.cat([pv, torch.stack([entries[p][1] for p in order])])
                    for h in range(g * G, (g + 1) * G):
                        w = (keys @ qq[b, h, 0].double() * D**-0.5).softmax(-1)
                        torch.testing.assert_close(out[b, h, 0].double(), w @ values, atol=1e-4, rtol=1e-4)
                        for p, x in zip(order, w[P:].tolist()):
                            entries[p][2] += x
                    cap = int(cache.head_cap[li, b, g])
                    order = sorted(entries)
                    victims = _greedy_stratified([entries[p][2] for p in order], order,
                                                 [q - p > W for p in order], len(order) - cap, lay)
                    for j in victims:
                        del entries[order[j]]
                    evicted += len(victims)
                    assert len(entries) <= cap
                    got = cache.spos[li, b, g]
                    assert sorted(got[got >= 0].tolist()) == sorted(entries), (i, li, b, g)
    assert evicted > 100
    assert len(set(cache.head_cap.flatten().tolist())) > 1  # per-head capacities were exercised


# -- diagonal-adaptive -----------------------------------------------------------------------------


def test_uncalibrated_use_fails_clearly():
    gpt = random_gpt("c2i", image_tokens=36)
    pol = get("diagonal-adaptive", rho=0.5, calib_rows=2)
    msg = r"not calibrated yet; call policy.calibrate\(gpt\)"
    with pytest.raises(PolicyError, match=msg):
        pol.offset_table(gpt.layout, 2, 4)
    with pytest.raises(PolicyError, match=msg):
        pol.make_cache(gpt.config, 1, torch.float32, "cpu")
    with pytest.raises(PolicyError, match=msg):
        pol.teacher_forced_logits(gpt, random_cond(gpt, 1), _tokens(gpt, 1, 0))
    b = pol.budget(gpt.layout)  # the bounds are known before calibration
    assert b.kept == int(0.5 * 36) and b.read == 1 + pol.read_budget(gpt.layout)


def test_capture_backend_is_exact():
    """Attention through the capture backend is plain attention; its mass per offset matches the
    full attention maps of a naive backend."""
    gpt = random_gpt("t2i", image_tokens=36, n_kv_head=2, seed=4)
    cfg, P = gpt.config, gpt.config.cls_token_num
    cond, tokens = random_cond(gpt, 3, seed=6), _tokens(gpt, 3, seed=7)[:, :14]

    maps = {}

    class Naive:
        def attend(self, layer, q, k, v):
            G = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            T = s.shape[-1]
            w = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            maps[layer] = w
            return w @ v

    with torch.no_grad():
        h = torch.cat([gpt.embed_cond(cond), gpt.tok_embeddings(tokens)], dim=1)
        pos = torch.arange(h.shape[1])
        cap = OffsetMassCapture(cfg.n_layer, cfg.n_head, 14, P, P + 14, P + 2, "cpu")
        out_cap = gpt.forward_hidden(h, pos, cap)
        out_ref = gpt.forward_hidden(h, pos)
        gpt.forward_hidden(h, pos, Naive())
    torch.testing.assert_close(out_cap, out_ref, atol=1e-4, rtol=1e-4)
    for li in range(cfg.n_layer):
        for d in range(14):
            qs = [q for q in range(P, P + 14) if q - d >= P + 2]
            want = sum(maps[li][:, :, q, q - d].sum(0) for q in qs) / (3 * len(qs)) if qs else None
            got = cap.mean_mass()[li, :, d]
            if want is None:
                assert torch.isinf(got).all()
            else:
                torch.testing.assert_close(got.float(), want, atol=1e-5, rtol=1e-4)
    # offset_mass wraps the same pass
    torch.testing.assert_close(offset_mass(gpt, cond, tokens, sinks=2), cap.mean_mass())


def test_choose_offsets_picks_the_heaviest():
    mean = torch.rand(2, 3, 20)
    mean[1, 2, 15:] = float("-inf")  # unmeasured
    table = choose_offsets(mean, local=3, window=17, count=7)
    for li, h in itertools.product(range(2), range(3)):
        offs = table[li][h]
        assert list(offs) == sorted(offs) and len(offs) == 7 and offs[:3] == (0, 1, 2) and max(offs) < 17
        rest = mean[li, h, 3:17]
        want = sorted((3 + rest.topk(4).indices).tolist())
        assert list(offs[3:]) == want


@pytest.mark.parametrize("rho, read", [(0.5, 0.5), (0.4, 1.0)])
def test_calibrated_tables_respect_the_budget(model_type, rho, read):
    gpt = random_gpt(model_type, image_tokens=36, seed=21)
    lay, cfg = gpt.layout, gpt.config
    pol = get("diagonal-adaptive", rho=rho, read=read, calib_rows=3, calib_samples=3, local=3)
    cal = pol.calibrate(gpt, seed=5)
    assert isinstance(cal, DiagonalAdaptivePolicy) and cal is not pol and pol.table is None
    assert cal.calibrated and cal.params()["table"] == cal.table
    hash(cal)
    with pytest.raises(Exception):
        cal.rho = 1.0  # frozen
    K, n = pol.window_budget(lay), pol.read_budget(lay)
    assert K == int(rho * dense_entries(lay)) - lay.prefix_len
    assert len(cal.table) == cfg.n_layer and all(len(layer) == cfg.n_head for layer in cal.table)
    for layer in cal.table:
        for offs in layer:
            assert set(range(3)) <= set(offs) and len(offs) == n and max(offs) < K
            assert lay.prefix_len + max(offs) + 1 <= rho * dense_entries(lay)
    b = cal.budget(lay)
    assert b.kept <= int(rho * dense_entries(lay)) and b.rho <= rho
    assert b.read <= lay.prefix_len + n
    assert cal.calibrate(gpt, seed=5).table == cal.table  # deterministic
    if read < 1:
        assert len({offs for layer in cal.table for offs in layer}) > 1  # heads differ
    else:
        assert all(offs == tuple(range(K)) for layer in cal.table for offs in layer)  # the whole window


def test_ring_decode_equals_masked_teacher_forcing(model_type):
    gpt = random_gpt(model_type, image_tokens=36, n_kv_head=2, seed=31)
    cond, tokens = random_cond(gpt, 3, seed=32), _tokens(gpt, 3, seed=33)
    pol = get("diagonal-adaptive", rho=0.5, read=0.6, calib_rows=2, calib_samples=2, local=2, sinks=1)
    cal = pol.calibrate(gpt, seed=1)
    with torch.no_grad():
        masked = gpt.logits(cond, tokens, policy=cal)
        dense = gpt.logits(cond, tokens)
    ring = _gen(gpt, cal).cached_logits(cond, tokens)
    torch.testing.assert_close(ring, masked, atol=1e-4, rtol=1e-4)
    assert (masked - dense).abs().max() > 1e-2  # sparse for real


def test_engine_and_logits_calibrate_automatically():
    gpt = random_gpt("c2i", image_tokens=36, seed=41)
    cond, tokens = random_cond(gpt, 2, seed=42), _tokens(gpt, 2, seed=43)
    pol = get("diagonal-adaptive", rho=0.5, calib_rows=2, calib_samples=2)
    gen = _gen(gpt, pol)
    assert gen.policy.calibrated and gen.policy.table == pol.calibrate(gpt).table
    with torch.no_grad():
        auto = gpt.logits(cond, tokens, policy=pol)
        explicit = gpt.logits(cond, tokens, policy=pol.calibrate(gpt))
    torch.testing.assert_close(auto, explicit, rtol=0, atol=0)
    torch.testing.assert_close(gen.cached_logits(cond, tokens), auto, atol=1e-4, rtol=1e-4)
    toks = gen.sample_tokens(cond, cfg_scale=2.0, seed=3)
    assert toks.shape == (2, 36)
    # other policies are returned as they are
    h2o = get("h2o", rho=0.5)
    assert h2o.prepare(gpt) is h2o and gen.policy.prepare(gpt) is gen.policy


def test_rho_one_read_one_is_dense(model_type):
    gpt = random_gpt(model_type, image_tokens=36, seed=51)
    cond, tokens = random_cond(gpt, 2, seed=52), _tokens(gpt, 2, seed=53)
    pol = get("diagonal-adaptive", rho=1.0, read=1.0, calib_rows=2, calib_samples=2)
    with torch.no_grad():
        dense = gpt.logits(cond, tokens)
        masked = gpt.logits(cond, tokens, policy=pol)
    ring = _gen(gpt, pol).cached_logits(cond, tokens)
    torch.testing.assert_close(masked, dense, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ring, dense, atol=1e-4, rtol=1e-4)


def test_table_from_another_model_is_refused():
    small = random_gpt("c2i", image_tokens=36, seed=1)
    cal = get("diagonal-adaptive", rho=0.5, calib_rows=2, calib_samples=1).calibrate(small)
    other = random_gpt("c2i", image_tokens=36, seed=1, n_layer=3)
    with pytest.raises(PolicyError, match=re.escape("calibrated for 2 layers x 4 heads, asked for 3 x 4")):
        cal.offset_table(other.layout, 3, 4)
