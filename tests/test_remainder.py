"""The mean-field remainder entry of offset policies (``remainder=True``): teacher forcing against a
direct per-query computation, the ring cache against teacher forcing, and where it runs."""
import math

import pytest
import torch

import arsparse.policies as policies
from arsparse.engine.continuous import make_row_cache, supports_continuous
from arsparse.engine.generator import Generator
from arsparse.policies import PolicyError
from conftest import random_cond, random_gpt


def adaptive(model, seed):
    """A diagonal-adaptive policy with a random table: different offsets per (layer, head)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    table = tuple(tuple(tuple(sorted({0, 1, *(torch.randint(2, 9, (3,), generator=g).tolist())}))
                        for _ in range(cfg.n_head)) for _ in range(cfg.n_layer))
    return policies.get("diagonal-adaptive", rho=0.5, local=2, sinks=1, table=table, remainder=True)


class Direct:
    """Reference backend: per (row, head, query) the read set from ``read_positions`` and the remainder
    (causal image keys past the sinks not read) averaged by hand, one softmax each."""

    def __init__(self, pol, layout, cfg, keep=None):
        self.pol, self.lay, self.cfg, self.keep = pol, layout, cfg, keep

    def attend(self, layer, q, k, v):
        B, H, T, D = q.shape
        G = H // k.shape[1]
        P = self.lay.prefix_len
        first = P + min(self.pol.sink_count(self.lay), self.lay.image_tokens - 1)
        out = torch.empty_like(q)
        for b in range(B):
            real = (lambda p: True) if self.keep is None else (lambda p: bool(self.keep[b, p]))
            for h in range(H):
                kk, vv = k[b, h // G], v[b, h // G]
                for t in range(T):
                    reads = self.pol.read_positions(self.lay, t, layer, h, self.cfg.n_layer, H)
                    reads = [p for p in reads if p >= P or real(p) or p == t]
                    rest = [p for p in range(first, t + 1) if p not in reads] if t >= P else []
                    logits = [q[b, h, t] @ kk[p] / math.sqrt(D) for p in reads]
                    vals = [vv[p] for p in reads]
                    if rest:
                        logits.append(q[b, h, t] @ kk[rest].mean(0) / math.sqrt(D) + math.log(len(rest)))
                        vals.append(vv[rest].mean(0))
                    out[b, h, t] = torch.stack(logits).softmax(0) @ torch.stack(vals)
        return out


def test_teacher_forced_remainder_equals_direct_computation():
    for kw, pol in [(dict(), policies.get("diagonal", local=2, rows=1, band=1, sinks=1, remainder=True)),
                    (dict(n_kv_head=2), None)]:
        model = random_gpt("c2i", seed=21, image_tokens=25, **kw)
        pol = pol or adaptive(model, 5)
        cond = random_cond(model, 2, seed=4)
        tokens = torch.randint(0, model.config.vocab_size, (2, 25), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            got = model.logits(cond, tokens, policy=pol)
            want = model.logits(cond, tokens, backend=Direct(pol, model.layout, model.config))
            plain = model.logits(cond, tokens, policy=type(pol)(**{**pol.params(), "remainder": False}))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert (got - plain).abs().max() > 0.1  # the remainder changes something


@pytest.mark.parametrize("case", ["diagonal", "streaming", "gqa-adaptive", "t2i-caption-mask"])
def test_ring_cache_decode_equals_teacher_forcing(case):
    kw = dict(n_kv_head=2) if case == "gqa-adaptive" else {}
    model = random_gpt("t2i" if case.startswith("t2i") else "c2i", seed=22, image_tokens=36, **kw)
    pol = {"diagonal": policies.get("diagonal", local=2, rows=1, band=1, sinks=2, remainder=True),
           "streaming": policies.get("streaming", sinks=1, recent=5, remainder=1),
           "t2i-caption-mask": policies.get("diagonal", local=3, rows=1, band=0, sinks=0, remainder=True),
           }.get(case) or adaptive(model, 7)
    cond = random_cond(model, 3, seed=8)
    tokens = torch.randint(0, model.config.vocab_size, (3, 36), generator=torch.Generator().manual_seed(9))
    mask = None
    if case.startswith("t2i"):
        mask = torch.ones(3, model.config.cls_token_num, dtype=torch.bool)
        mask[0, :2] = False  # left padding
        mask[2, 3:] = False  # right padding
    cached = Generator(model, device="cpu", policy=pol).cached_logits(cond, tokens, prompt_mask=mask)
    with torch.no_grad():
        forced = model.logits(cond, tokens, policy=pol, prompt_mask=mask)
        if mask is not None:
            direct = model.logits(cond, tokens, backend=Direct(pol, model.layout, model.config, keep=mask))
            torch.testing.assert_close(forced, direct, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cached, forced, atol=1e-4, rtol=1e-4)


def test_no_remainder_where_every_image_key_is_read():
    """Queries that read every causal image key (count 0) get exactly the plain policy; later ones differ."""
    model = random_gpt("c2i", seed=23, image_tokens=36)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 36), generator=torch.Generator().manual_seed(2))
    on = policies.get("diagonal", local=4, rows=1, band=0, sinks=2, remainder=True)
    off = policies.get("diagonal", local=4, rows=1, band=0, sinks=2)
    # image index i reads sinks 0, 1 and offsets 0..3: all of 0..i while i <= 5; token t is predicted at i = t - 1
    early = 7
    with torch.no_grad():
        a, b = model.logits(cond, tokens, policy=on), model.logits(cond, tokens, policy=off)
    torch.testing.assert_close(a[:, :early], b[:, :early], atol=2e-5, rtol=2e-5)  # SDPA against an explicit softmax
    assert (a[:, early:] - b[:, early:]).abs().max() > 0.1
    ca = Generator(model, device="cpu", policy=on).cached_logits(cond, tokens)
    cb = Generator(model, device="cpu", policy=off).cached_logits(cond, tokens)
    torch.testing.assert_close(ca[:, :early], cb[:, :early], atol=1e-6, rtol=1e-6)


def test_remainder_false_is_the_plain_policy():
    model = random_gpt("c2i", seed=24, image_tokens=25)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 25))
    for name in ["diagonal", "streaming"]:
        pol = policies.resolve(f"{name}:remainder=0")
        assert pol == policies.get(name) and pol.remainder is False
        with torch.no_grad():
            assert torch.equal(model.logits(cond, tokens, policy=pol), model.logits(cond, tokens, policy=name))


def test_remainder_flag_is_validated_and_listed():
    assert policies.resolve("diagonal:remainder=1").remainder is True
    assert policies.resolve("streaming:remainder=true").remainder is True
    for bad in [2, -1, 0.5, "yes", None]:
        with pytest.raises(PolicyError, match="remainder"):
            policies.get("diagonal", remainder=bad)
    for name in ["diagonal", "streaming", "diagonal-adaptive"]:
        assert policies.get(name).describe()["params"]["remainder"] is False


def test_remainder_budget_and_memory_count_the_running_sums():
    from arsparse.layout import Layout

    lay = Layout(3, 7, 9)
    for name in ["diagonal", "streaming:recent=9"]:
        off, on = policies.resolve(name), policies.resolve(f"{name}{',' if ':' in name else ':'}remainder=1")
        a, b = off.budget(lay), on.budget(lay)
        assert (b.kept, b.read) == (a.kept + 2, a.read + 2)
    # Sized by rho, the sums count against it: the ring shrinks by two entries.
    for name, rho in [("streaming", 0.3), ("diagonal", 0.5), ("diagonal-adaptive", 0.3)]:
        a, b = (policies.get(name, rho=rho, remainder=r).budget(lay) for r in (False, True))
        assert b.kept <= rho * b.dense and b.kept - 2 <= a.kept
    model = random_gpt("c2i", image_tokens=36, n_kv_head=2)
    cfg = model.config
    sizes = [policies.get("diagonal", remainder=r, rows=1).make_cache(cfg, 3, torch.bfloat16, "cpu").nbytes()
             for r in (False, True)]
    assert sizes[1] - sizes[0] == 2 * cfg.n_layer * 3 * cfg.kv_heads * cfg.head_dim * 4  # fp32 K and V sums


def test_continuous_batching_takes_the_remainder():
    """Row caches keep one set of sums per row (tokens against the offline generator: test_serve_engine)."""
    model = random_gpt("c2i", image_tokens=16)
    pol = policies.get("streaming", recent=4, remainder=True)
    assert supports_continuous(pol)
    cache = make_row_cache(pol, model.config, 3, torch.float32, "cpu")
    assert cache.remainder and tuple(cache.ksum.shape[1:3]) == (3, model.config.kv_heads)
