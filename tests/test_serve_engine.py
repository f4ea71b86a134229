"""Continuous batching in the engine: slots at their own positions give exactly the offline tokens."""
import traceback

import pytest
import torch

from arsparse import policies
from arsparse.engine.continuous import RowDenseKVCache, RowRingKVCache, SlotDecoder, make_row_cache
from arsparse.engine.generator import Generator, row_keys, sampling_rows
from conftest import random_cond, random_gpt

# Small enough for an 8x8 grid, large enough that the ring buffer wraps (window 18 of 63 positions).
OFFSET_POLICIES = {
    "diagonal": dict(local=3, rows=2, band=1, sinks=2),
    "streaming": dict(sinks=2, recent=5),
    "diagonal+remainder": dict(local=3, rows=2, band=1, sinks=2, remainder=True),  # mean-field entry: per-row sums
}


def _policy(key):
    return policies.get(key.split("+")[0], **OFFSET_POLICIES[key]) if key else None


def _requests(model, count, seed):
    """Requests with fresh random conditions, seeds and sampling arguments (guidance on and off)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(1, 4, (1,), generator=g))
        out.append(dict(
            n=n, cond=random_cond(model, n, seed=seed * 100 + i), seed=int(torch.randint(0, 2**40, (1,), generator=g)),
            cfg_scale=[1.0, 2.5, 4.0][i % 3], temperature=float(torch.rand((), generator=g)) * 1.5,
            top_k=[0, 5, 1, 0][i % 4], top_p=[1.0, 0.8][i % 2], cfg_interval=[-1, 3][i % 2]))
    return out


def _offline(gen, r):
    return gen.sample_tokens(r["cond"], cfg_scale=r["cfg_scale"], temperature=r["temperature"], top_k=r["top_k"],
                             top_p=r["top_p"], seed=r["seed"], cfg_interval=r["cfg_interval"],
                             prompt_mask=r.get("mask"))


def _serve(dec, reqs, arrivals):
    """Admit request i at step arrivals[i] (or as soon as it fits after), step until all are done."""
    owner, results, step = {}, {}, 0
    waiting = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    joined_mid_flight = 0
    while len(results) < len(reqs):
        while waiting and arrivals[waiting[0]] <= step and len(dec.free_slots()) >= reqs[waiting[0]]["n"]:
            i = waiting.pop(0)
            r = reqs[i]
            slots = dec.free_slots()[: r["n"]]
            joined_mid_flight += bool(owner)
            dec.admit(slots, r["cond"], row_keys(r["seed"], r["n"]),
                      sampling_rows(r["n"], r["cfg_scale"], r["temperature"], r["top_k"], r["top_p"], r["cfg_interval"]),
                      prompt_mask=r.get("mask"))
            owner[i] = slots
        dec.step()
        done = set(dec.done())
        for i, slots in list(owner.items()):
            if set(slots) <= done:
                results[i] = dec.tokens(slots).clone()
                dec.release(slots)
                del owner[i]
        step += 1
    return results, joined_mid_flight


@pytest.mark.parametrize("policy", [None, "diagonal", "streaming", "diagonal+remainder"])
def test_requests_joining_mid_flight_get_the_offline_tokens(model_type, policy):
    model = random_gpt(model_type, image_tokens=64, seed=2, n_kv_head=2 if policy == "streaming" else None)
    pol = _policy(policy)
    gen = Generator(model, device="cpu", policy=pol)
    dec = SlotDecoder(gen, slots=6, guidance=True)
    reqs = _requests(model, 7, seed=3 + (policy is None))
    arrivals = [0, 0, 5, 9, 30, 31, 70]
    results, joined = _serve(dec, reqs, arrivals)
    assert joined >= 3  # requests really did join a running batch, into slots others had used
    for i, r in enumerate(reqs):
        want = _offline(gen, r)
        assert torch.equal(results[i], want), f"request {i}"
    # Not vacuous: another seed gives other tokens.
    other = dict(reqs[0], seed=reqs[0]["seed"] + 1, temperature=1.0, top_k=0)
    assert not torch.equal(_offline(gen, other), _offline(gen, dict(other, seed=reqs[0]["seed"])))


@pytest.mark.parametrize("policy", [None, "diagonal", "diagonal+remainder"])
def test_padded_captions_joining_mid_flight_get_the_offline_tokens(policy):
    """t2i caption masks in continuous batching: each slot's mask is set as its request joins (left,
    right or no padding, mixed in one pool, slots reused), and every request gets exactly the tokens
    of the offline generator with the same mask. (PyTorch path; the Triton kernels read the same
    per-row spans, checked against it in tests/test_prompt_mask.py.)"""
    model = random_gpt("t2i", image_tokens=64, seed=12)
    P = model.config.cls_token_num
    pol = _policy(policy)
    gen = Generator(model, device="cpu", policy=pol)
    dec = SlotDecoder(gen, slots=5, guidance=True)
    reqs = _requests(model, 6, seed=21)
    g = torch.Generator().manual_seed(22)
    for i, r in enumerate(reqs):
        if i % 3 == 2:
            continue  # unpadded: the slot's previous mask must not leak into it
        keep = torch.randint(1, P, (r["n"],), generator=g)
        pos = torch.arange(P)[None, :]
        r["mask"] = pos >= P - keep[:, None] if i % 3 == 0 else pos < keep[:, None]  # left / right padding
    results, joined = _serve(dec, reqs, [0, 0, 4, 30, 31, 60])
    assert joined >= 2
    for i, r in enumerate(reqs):
        assert torch.equal(results[i], _offline(gen, r)), f"request {i}"
    # Not vacuous: the mask changes the tokens.
    r = reqs[0]
    assert not torch.equal(_offline(gen, r), _offline(gen, dict(r, mask=None)))


def test_graph_shapes_give_the_same_tokens_and_capture_failure_falls_back(caplog, monkeypatch):
    """With CUDA graphs on, steps run at bucketed shapes (more slots, a larger top-k bound); where
    capture fails, the plan runs eagerly for good, with the same tokens."""
    def refuse(*args, **kwargs):  # capture fails on any machine (on a GPU one, capturing CPU work would not)
        raise RuntimeError("capture refused by the test")
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    model = random_gpt("c2i", image_tokens=64, seed=6)
    gen = Generator(model, device="cpu")
    dec = SlotDecoder(gen, slots=8, guidance=True)
    dec.cuda_graphs = True  # what the constructor sets on CUDA
    reqs = _requests(model, 5, seed=9)
    results, joined = _serve(dec, reqs, [0, 2, 3, 40, 41])
    assert joined >= 2
    for i, r in enumerate(reqs):
        assert torch.equal(results[i], _offline(gen, r)), f"request {i}"
    plans = set(dec._graphs)
    assert {w for w, _, _ in plans} <= {1, 2, 4, 8} and (8, 8, True) in plans  # buckets: top_k 5 -> bound 8
    assert all(g is None for g in dec._graphs.values()) and "capture failed" in caplog.text


def test_row_caches_for_each_policy_kind():
    cfg = random_gpt("c2i").config
    assert isinstance(make_row_cache(None, cfg, 2, torch.float32, "cpu"), RowDenseKVCache)
    assert isinstance(make_row_cache(policies.get("dense"), cfg, 2, torch.float32, "cpu"), RowDenseKVCache)
    assert isinstance(make_row_cache(policies.get("streaming"), cfg, 2, torch.float32, "cpu"), RowRingKVCache)
    with pytest.raises(policies.PolicyError, match="h2o: a scored policy"):
        make_row_cache(policies.get("h2o"), cfg, 2, torch.float32, "cpu")


def test_per_row_positions_match_shared_positions():
    model = random_gpt("c2i", image_tokens=16, seed=4)
    h = torch.randn(3, 5, model.config.dim)
    shared = model.forward_hidden(h, torch.arange(2, 7))
    per_row = model.forward_hidden(h, torch.arange(2, 7).expand(3, 5))
    assert torch.equal(shared, per_row)
    mixed = model.forward_hidden(h[:1], torch.tensor([[4, 5, 6, 7, 8]]))
    assert torch.allclose(mixed, model.forward_hidden(h[:1], torch.arange(4, 9)))
    assert not torch.allclose(mixed, shared[:1], atol=1e-3)


def test_decoder_rejects_misuse():
    model = random_gpt("c2i", image_tokens=16)
    gen = Generator(model, device="cpu")
    dec = SlotDecoder(gen, slots=2, guidance=False)
    rows = sampling_rows(1, cfg_scale=2.0)
    with pytest.raises(ValueError, match="no guidance rows"):
        dec.admit([0], torch.tensor([1]), row_keys(0, 1), rows)
    dec.admit([0], torch.tensor([1]), row_keys(0, 1), sampling_rows(1, cfg_scale=1.0))
    with pytest.raises(ValueError, match=r"slots \[0\] are busy"):
        dec.admit([0], torch.tensor([1]), row_keys(0, 1), sampling_rows(1, cfg_scale=1.0))
    with pytest.raises(ValueError, match="class labels must be in"):
        dec.admit([1], torch.tensor([99]), row_keys(0, 1), sampling_rows(1, cfg_scale=1.0))
    with pytest.raises(ValueError, match="prompt_mask is for text-conditional"):
        dec.admit([1], torch.tensor([1]), row_keys(0, 1), sampling_rows(1, cfg_scale=1.0),
                  prompt_mask=torch.ones(1, model.config.cls_token_num, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy,compiled", [(None, False), ("diagonal", False), ("diagonal+remainder", False),
                                             ("diagonal", True)])
def test_cuda_graph_steps_equal_eager_steps_on_gpu(policy, compiled):
    """Steps replayed from CUDA graphs == the same steps run eagerly (compiled: the server's --compile)."""
    model = random_gpt("c2i", image_tokens=64, seed=7)
    pol = _policy(policy)
    gen = Generator(model, device="cuda", dtype="bf16", policy=pol, compile=compiled, compile_dynamic=compiled)
    reqs = _requests(model, 6, seed=11)
    arrivals = [0, 1, 2, 20, 21, 50]
    graphed = SlotDecoder(gen, slots=8, guidance=True, cuda_graphs=True)
    got, _ = _serve(graphed, reqs, arrivals)
    assert any(g is not None for g in graphed._graphs.values())  # steps were replayed from graphs
    eager = SlotDecoder(gen, slots=8, guidance=True, cuda_graphs=True)
    eager._graph_for = lambda plan: None  # the same bucketed shapes, run eagerly
    want, _ = _serve(eager, reqs, arrivals)
    for i in range(len(reqs)):
        assert torch.equal(got[i], want[i]), f"request {i}"


def test_slot_bookkeeping_matches_a_brute_force_count():
    """free_slots / busy / width / done / sampled are kept incrementally; against a plain count per slot
    over random admissions (any free slots, not only the lowest), steps and releases (mid-flight too)."""
    model = random_gpt("c2i", image_tokens=9, seed=13)
    gen = Generator(model, device="cpu")
    dec = SlotDecoder(gen, slots=7, guidance=False)
    N, rng = 9, torch.Generator().manual_seed(14)
    count = [0] * 7  # tokens each slot holds; 0 = free

    def check():
        assert dec.free_slots() == [s for s in range(7) if count[s] == 0]
        assert dec.busy() == sum(c > 0 for c in count)
        assert dec.width() == max((s + 1 for s in range(7) if count[s]), default=0)
        assert dec.done() == [s for s in range(7) if count[s] == N]
        assert [dec.sampled(s) for s in range(7)] == count

    admitted = finished = done_before = 0
    for _ in range(80):
        action = int(torch.randint(0, 5, (1,), generator=rng))
        free = dec.free_slots()
        if action == 0 and free:
            k = int(torch.randint(1, len(free) + 1, (1,), generator=rng))
            slots = [free[int(i)] for i in torch.randperm(len(free), generator=rng)[:k]]
            dec.admit(slots, torch.randint(0, 5, (k,), generator=rng), row_keys(admitted, k), sampling_rows(k, 1.0))
            admitted += 1
            for s in slots:
                count[s] = 1
        elif action == 1 and dec.busy():
            busy = [s for s in range(7) if count[s]]
            slots = [busy[int(i)] for i in torch.randperm(len(busy), generator=rng)[: len(busy) // 2 + 1]]
            dec.release(slots)
            for s in slots:
                count[s] = 0
        else:
            live = sum(0 < c < N for c in count)
            assert dec.step() == live
            count = [c + 1 if 0 < c < N else c for c in count]
            finished += sum(c == N for c in count) - done_before
        check()
        done_before = sum(c == N for c in count)
    assert admitted >= 5 and finished >= 3  # the sequence did admit, finish and release


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_phases_do_not_wait_for_the_gpu():
    """Admission, steps, release and the scheduler's finish (VQ decode, copy to pinned host memory) queue
    work on the device without a host-device sync (torch's sync debug mode raises at any)."""
    from arsparse.serve.scheduler import _to_host
    from arsparse.tokenizers import PaletteTokenizer

    model = random_gpt("c2i", image_tokens=16, seed=15)
    gen = Generator(model, PaletteTokenizer(48), device="cuda", dtype="bf16")
    dec = SlotDecoder(gen, slots=4, guidance=True)
    synced = []

    def phase(name, fn):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        except RuntimeError as e:  # where, in arsparse: the innermost frames of ours
            where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.line}"
                     for f in traceback.extract_tb(e.__traceback__) if "/arsparse/" in f.filename]
            synced.append(f"{name}: {e} at {where[-2:]}")
        finally:
            torch.cuda.set_sync_debug_mode(0)

    for _ in range(2):  # the second round: every lazy initialisation has happened
        synced.clear()
        phase("admit", lambda: dec.admit([0, 2], torch.tensor([1, 3]), row_keys(5, 2), sampling_rows(2, 2.0, top_k=5)))
        for _ in range(15):
            phase("step", dec.step)
        assert not synced, synced
        assert dec.done() == [0, 2]
        tokens = phase("tokens", lambda: dec.tokens([0, 2]))
        phase("release", lambda: dec.release([0, 2]))
        phase("finish", lambda: (_to_host(gen.decode_images(tokens, host=False, check_range=False)),
                                torch.cuda.Event().record()))
    assert not synced, synced


def test_blocks_compiled_for_any_batch_size_give_the_offline_tokens():
    """The server's --compile: the blocks compiled with symbolic batch sizes serve every prefill and
    step width of continuous batching without a program per shape (a second round of other sizes
    compiles nothing new), with the offline generator's tokens (greedy, so float reassociation in
    the compiled code cannot flip a draw)."""
    import copy

    from torch._dynamo.utils import counters

    model = random_gpt("c2i", image_tokens=16, seed=5)
    reqs = [dict(r, top_k=1, top_p=1.0) for r in _requests(model, 8, seed=8)]
    offline = Generator(model, device="cpu")
    want = [_offline(offline, r) for r in reqs]
    torch._dynamo.reset()
    counters.clear()
    dec = SlotDecoder(Generator(copy.deepcopy(model), device="cpu", compile=True, compile_dynamic=True), slots=6,
                      guidance=True)
    widths, step = [], dec.step
    dec.step = lambda: (widths.append(dec.width()), step())[1]
    first, _ = _serve(dec, reqs[:4], [0, 0, 3, 6])
    graphs, seen = counters["stats"]["unique_graphs"], set(widths)
    second, _ = _serve(dec, reqs[4:], [0, 2, 4, 5])
    assert set(widths) - seen  # the second round stepped at widths the first did not
    assert counters["stats"]["unique_graphs"] == graphs > 0  # and compiled nothing for them
    for i, got in enumerate([first[j] for j in range(4)] + [second[j] for j in range(4)]):
        assert torch.equal(got, want[i]), f"request {i}"
    torch._dynamo.reset()
