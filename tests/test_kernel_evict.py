"""HeadKV's stratified eviction as Triton kernels against its PyTorch form (itself checked against greedy
rounds in test_policies_headwise.py), on the CPU through the Triton interpreter."""
import os
import random

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse.kernels.triton.evict import stratified_evict_slots  # noqa: E402
from arsparse.layout import Layout  # noqa: E402
from arsparse.policies.headwise import stratified_evict  # noqa: E402
from conftest import compile_for_hopper  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_int_empty(monkeypatch):
    """Integer buffers the wrapper allocates start as -1, so an output element never written shows."""
    empty = torch.empty

    def poisoned(*args, **kw):
        t = empty(*args, **kw)
        return t if t.is_floating_point() or t.dtype == torch.bool else t.fill_(-1)

    monkeypatch.setattr(torch, "empty", poisoned)


def _tables(g, L, B, H, C, lay, ties: bool):
    """One layer's slice of (L, B, H, C) score/position tables (as the cache holds them), an evictable
    mask within the held slots, and ``k`` from -1 to past the evictable count, with k = 1 and k > 1 present."""
    n_img = lay.grid_h * lay.row_stride
    score = torch.randint(0, 5, (L, B, H, C), generator=g).float() / 4 if ties else torch.rand(L, B, H, C, generator=g)
    pos = lay.prefix_len + torch.randint(0, n_img, (L, B, H, C), generator=g)
    pos[torch.rand(L, B, H, C, generator=g) < 0.15] = -1
    layer = int(torch.randint(0, L, (), generator=g))
    score, pos = score[layer], pos[layer]
    evictable = (pos >= 0) & (torch.rand(B, H, C, generator=g) < 0.75)
    k = torch.randint(-1, C + 2, (B, H, 1), generator=g) // torch.randint(1, 8, (B, H, 1), generator=g)
    k.view(-1)[0], k.view(-1)[-1] = 1, 3
    return score, pos, evictable, k


@pytest.mark.parametrize("B,H,C,grid,ties", [
    (3, 4, 83, (24, 24), False),  # a GPT-XL-like head table at 576 tokens (C < one tile pair)
    (2, 3, 150, (28, 28), True),  # fashion's rows, many tied scores, C over two tiles
    (4, 2, 9, (5, 3), True),  # tiny rows: most rows hold many entries
    (1, 5, 200, (32, 32), False),  # 1,024 tokens, 32 rows (a full BLOCK_R)
    (2, 2, 64, (40, 8), False),  # more rows than a power of two below them (BLOCK_R 64)
    (5, 7, 40, (12, 12), True),  # 35 tables: evict_many's programs take 3 each (off CUDA), the last 2
])
def test_stratified_evict_kernels_match_torch(poisoned_int_empty, B, H, C, grid, ties):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    prefix = int(torch.randint(1, 5, (), generator=g))
    lay = Layout(prefix, *grid, row_stride=grid[1] + int(torch.randint(0, 2, (), generator=g)))
    score, pos, evictable, k = _tables(g, 3, B, H, C, lay, ties)
    want = stratified_evict(score, pos, evictable, k, lay)
    got = stratified_evict_slots(*(t.to(DEVICE) for t in (score, pos, evictable, k)), lay)
    raw = got.view(torch.int8).cpu()
    assert ((raw == 0) | (raw == 1)).all(), f"unwritten output (seed {seed})"
    assert torch.equal(got.cpu(), want), f"seed {seed}: {(got.cpu() != want).nonzero().tolist()[:8]}"
    freed = want.sum(-1, keepdim=True)  # as many as asked, where that many are evictable
    assert torch.equal(freed, torch.minimum(k.clamp_min(0), evictable.sum(-1, keepdim=True))), f"seed {seed}"


def test_stratified_evict_kernels_one_victim_from_the_fullest_row():
    """k = 1 by hand: the fullest row's weakest evictable entry, not the weakest overall; equally full
    rows: the weaker of their candidates; the slot breaks exact ties; no evictable entry: nothing."""
    lay = Layout(1, 6, 4)
    pos = torch.tensor([[[1, 2, 3, 5, 6, 7, 8, 9, 11, -1]]])  # row 0: 3, row 1: 4, row 2: 2 entries
    score = torch.tensor([[[0.5, 0.6, 0.7, 0.9, 0.4, 0.8, 0.45, 0.05, 0.06, 0.0]]])
    one = torch.ones(1, 1, 1, dtype=torch.long)
    ev = pos >= 0
    assert stratified_evict_slots(score, pos, ev, one, lay)[0, 0].nonzero().flatten().tolist() == [4]
    ev2 = ev.clone()
    ev2[..., 3:6] = False  # row 1 still the fullest (protected entries count) but its only candidate is 0.45
    assert stratified_evict_slots(score, pos, ev2, one, lay)[0, 0].nonzero().flatten().tolist() == [6]
    tied = torch.full_like(score, 0.3)
    assert stratified_evict_slots(tied, pos, ev, one, lay)[0, 0].nonzero().flatten().tolist() == [3]
    assert not stratified_evict_slots(score, pos, torch.zeros_like(ev), one, lay).any()
    last = Layout(1, 4, 4)  # (a power-of-two row count: the last row is counted like the others)
    pos = torch.tensor([[[13, 14, 15, 16, 2, 3, 6, -1]]])  # row 3: 4 entries, rows 0 and 1: 2 and 1
    score = torch.tensor([[[0.5, 0.3, 0.6, 0.7, 0.1, 0.2, 0.05, 0.0]]])
    assert stratified_evict_slots(score, pos, pos >= 0, one, last)[0, 0].nonzero().flatten().tolist() == [1]


def test_stratified_evict_slots_rejects_bad_inputs():
    lay = Layout(1, 4, 4)
    score, pos = torch.rand(2, 3, 8), torch.zeros(2, 3, 8, dtype=torch.long)
    ev, k = pos >= 0, torch.ones(2, 3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="score must be"):
        stratified_evict_slots(score[0], pos, ev, k, lay)
    with pytest.raises(ValueError, match="pos must be torch.int64"):
        stratified_evict_slots(score, pos.int(), ev, k, lay)
    with pytest.raises(ValueError, match=r"k must be torch.int64 \(2, 3, 1\)"):
        stratified_evict_slots(score, pos, ev, k[..., 0], lay)
    with pytest.raises(ValueError, match="unit last stride"):
        stratified_evict_slots(score.transpose(1, 2).contiguous().transpose(1, 2), pos, ev, k, lay)


def test_stratified_evict_kernels_build_for_hopper():
    """The interpreter runs Python; only a build shows the compiled form accepts the code."""
    ptr = dict(SCORE="*fp32", POS="*i64", EV="*u8", K="*i64", RANK="*i32", OUT="*i8")
    compile_for_hopper("arsparse.kernels.triton._evict", "evict_one_kernel", ptr,
                       {"one-32-rows": (dict(BLOCK_R=32, BLOCK_C=64), 4)})
    compile_for_hopper("arsparse.kernels.triton._evict", "evict_many_kernel", ptr,
                       {"many": (dict(BLOCK_T=64, BLOCK_I=32, BLOCK_J=64), 4, ["bar.sync"])})
