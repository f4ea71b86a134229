"""Triton kernels against the PyTorch reference, on the CPU through the Triton interpreter.

The decode kernels do the cache's whole step: attend (the new token from registers) and write the
new token into the cache. Each check runs
the reference on a copy of the buffers and asserts the same output and the same buffers after
the call (so the write happened, at the right slot, and nothing else changed); cache entries the
kernel must not read (past the position, not in the read set, or about to be overwritten) are NaN.
"""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse.kernels.reference import decode_attention_ref, ring_decode_attention_ref  # noqa: E402
from arsparse.kernels.triton import decode_attention, ring_decode_attention  # noqa: E402
from conftest import (compile_for_hopper, random_decode_case, random_offsets, random_ring_case,  # noqa: E402
                      random_span, row_positions)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=2e-5, rtol=2e-5)
DOT = dict(dot=1, small_dot=1)  # (decode.LAUNCH: tensor-core products at every shape)


def _same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("B,H,Hkv,S,D,pos,splits", [
    (2, 4, 4, 70, 64, 0, None),  # the first position: the new token alone
    (3, 4, 2, 130, 64, 129, 3),  # GQA, the last position, uneven splits
    (1, 2, 2, 200, 100, 128, 4),  # head_dim 100 (GPT-3B); pos opens the second split
    (2, 8, 1, 65, 128, 64, None),  # MQA, head_dim 128
    (4, 4, 2, 300, 64, "rows", 3),  # one position per row: 0, a split start, the last, random
    (3, 6, 3, 90, 100, "rows", 1),  # per row, one split (the output written directly)
    (3, 4, 1, 150, 128, "rows", 2),  # per row, MQA, head_dim 128
    (2, 2, 2, 40, 8, "rows", 2),  # head_dim 8 (tensor-core tiles pad it to 16)
])
@pytest.mark.parametrize("launch,dtype", [
    ({}, torch.float32), (dict(dot=0, small_dot=0), torch.float32), (DOT, torch.float32), (DOT, torch.bfloat16),
    (DOT, torch.float16), (dict(prefetch=1, dot=0, small_dot=0, block_n=16, small_block_n=16), torch.float32),
    (dict(DOT, prefetch=1, block_n=16, small_block_n=16), torch.bfloat16), (dict(programs=3), torch.float32),
    (dict(DOT, programs=5), torch.bfloat16)],
    ids=["engine", "cuda-cores", "dot", "dot-bf16", "dot-fp16", "prefetch-16", "prefetch-dot-bf16", "persistent-3",
         "persistent-dot-bf16"])
def test_decode_attention_writes_and_matches_reference(poisoned_empty, monkeypatch, B, H, Hkv, S, D, pos, splits, launch,
                                                       dtype):
    """``launch``: decode.LAUNCH settings: ``dot``/``small_dot``, the products on tensor cores (the engine's
    defaults take them for shapes that fill the GPU only); ``prefetch``, the next tile loaded before the
    current one is read (16-key tiles: many passes, a last partial one); ``programs``, a grid of 3 programs
    (fewer than every case's (row, kv head, split) triples) or 5 that take the triples in turn."""
    from arsparse.kernels.triton import decode

    monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, **launch))
    tol = TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    inputs, (want, want_k, want_v) = random_decode_case(B, H, Hkv, S, D, pos, dtype, S * 7 + D + B, DEVICE)
    got = decode_attention(*inputs, num_splits=splits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    _same([inputs[3].cpu(), inputs[4].cpu()], [want_k, want_v])


@pytest.mark.parametrize("small,big", [(64, 128), (16, 64)])
def test_few_row_head_pairs_take_the_small_tile_and_more_splits(small, big, monkeypatch):
    """Below one (row, kv head) pair per SM (8 off CUDA) the split kernel takes small_block_n tiles,
    and choose_splits caps the splits at the cache's tiles of that size."""
    from arsparse.kernels.triton import decode

    cpu = torch.device("cpu")
    monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, small_block_n=small, block_n=big))
    assert decode.block_n(1, 7, cpu) == small < decode.block_n(2, 4, cpu) == big
    assert decode.choose_splits(1, 1, 200, cpu) == -(-200 // small)  # 32 wanted
    assert decode.choose_splits(8, 1, 200, cpu) == -(-200 // big)  # 4 wanted
    assert decode.choose_splits(8, 1, 200, cpu, tile=16) == 4 and decode.choose_splits(1, 1, 200, cpu, tile=16) == 13


@pytest.mark.parametrize("cap", [1, 3])
def test_small_splits_caps_the_splits_below_one_pair_per_sm_only(cap, monkeypatch):
    """``small_splits`` bounds the dense kernel's splits where the pairs do not fill the GPU; the slot
    kernel's (its own tile) and full-GPU launches keep theirs. One split writes the output itself."""
    from arsparse.kernels.triton import decode

    cpu = torch.device("cpu")
    monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, small_block_n=16, block_n=16, small_splits=cap))
    assert decode.choose_splits(1, 1, 200, cpu) == cap  # 13 tiles, 32 splits wanted
    assert decode.choose_splits(8, 1, 200, cpu) == 4 and decode.choose_splits(1, 1, 200, cpu, tile=16) == 13
    inputs, (want, want_k, want_v) = random_decode_case(1, 4, 2, 200, 32, "rows", torch.float32, 11 * cap, DEVICE)
    got = decode_attention(*inputs, num_splits=decode.choose_splits(1, 2, 200, cpu))
    torch.testing.assert_close(got.cpu(), want, **TOL)
    _same([inputs[3].cpu(), inputs[4].cpu()], [want_k, want_v])


@pytest.mark.parametrize("dot,small_dot", [(1, 0), (0, 1)])
def test_tensor_cores_follow_whether_the_pairs_fill_the_gpu(dot, small_dot, monkeypatch):
    """``dot`` applies where the (row, kv head) pairs give each SM one (8 off CUDA), ``small_dot`` below."""
    from arsparse.kernels.triton import decode

    cpu = torch.device("cpu")
    monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, dot=dot, small_dot=small_dot))
    assert decode.tensor_cores(2, 4, cpu) is bool(dot) and decode.tensor_cores(8, 1, cpu) is bool(dot)
    assert decode.tensor_cores(1, 7, cpu) is bool(small_dot) and decode.tensor_cores(3, 2, cpu) is bool(small_dot)


def test_dense_launch_settings_parse_and_reject_bad_ones():
    from arsparse.kernels.triton import decode

    assert decode.parse_launch('{"block_n": 64, "prefetch": 1}') == dict(decode.LAUNCH, block_n=64, prefetch=1)
    assert decode.parse_launch("{}") == decode.LAUNCH
    assert decode.parse_launch('{"programs": 66}')["programs"] == 66
    for text, msg in (("block_n=64", "must be a JSON object"), ('{"warps": 2}', r"keys from \['block_n'"),
                      ('{"block_n": 48}', "block_n=48 is invalid: must be a power of 2 >= 16"),
                      ('{"small_block_n": 8}', "power of 2 >= 16"), ('{"num_warps": 32}', "1, 2, 4, 8 or 16"),
                      ('{"num_stages": 0}', "an int >= 1"), ('{"prefetch": 2}', "prefetch=2 is invalid: must be 0 or 1"),
                      ('{"dot": true}', "dot=True is invalid"), ('{"small_dot": 2}', "small_dot=2 is invalid"),
                      ('{"small_splits": -1}', "small_splits=-1 is invalid: must be an int >= 0")):
        with pytest.raises(ValueError, match=msg):
            decode.parse_launch(text)


def test_decode_attention_strided_inputs_and_cache_slice():
    """q, k, v as the model produces them (transposed views, k and v with different strides) and a
    cache that is one layer of a bigger buffer: only that layer's slot changes."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(3, 2, 4, 96, 64, generator=g).to(DEVICE)  # (L, B, Hkv, S, D)
    q = torch.randn(2, 1, 4, 64, generator=g).to(DEVICE).transpose(1, 2)[:, :, 0]  # (B, H, D), non-contiguous
    k_new = torch.randn(2, 1, 4, 64, generator=g).to(DEVICE).transpose(1, 2)[:, :, 0]
    v_new = torch.randn(2, 4, 3, 64, generator=g).to(DEVICE)[:, :, 1]
    p = torch.tensor(50, device=DEVICE)
    want_cache = cache.clone()
    want = decode_attention_ref(q, k_new, v_new, want_cache[1], want_cache[2], p)
    got = decode_attention(q, k_new, v_new, cache[1], cache[2], p)
    torch.testing.assert_close(got, want, **TOL)
    _same([cache], [want_cache])


def test_decode_attention_rejects_bad_input():
    q, kv = torch.randn(2, 4, 64), torch.randn(2, 4, 10, 64)
    new = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="H % Hkv"):
        decode_attention(q, new[:, :3], new[:, :3], kv[:, :3], kv[:, :3], torch.tensor(3))
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(q.half(), new, new, kv, kv, torch.tensor(3))
    with pytest.raises(ValueError, match=r"k_new must be \(B=2, Hkv=4, D=64\)"):
        decode_attention(q, new[:, :2], new, kv, kv, torch.tensor(3))
    with pytest.raises(ValueError, match=r"one per row \(2,\)"):
        decode_attention(q, new, new, kv, kv, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="pos must be an integer tensor"):
        decode_attention(q, new, new, kv, kv, torch.tensor(3.0))


@pytest.mark.parametrize("launch", [None, dict(rows_per_program=2, late_cast=True),
                                    dict(rows_per_program=4, heads_first=True, early_loads=False),
                                    dict(merged=False), dict(merged=False, early_loads=False, late_cast=True)],
                         ids=["engine", "rows2-late", "rows4-heads-first-wait-first", "three-tiles",
                              "three-tiles-late-wait-first"])
@pytest.mark.parametrize("B,H,Hkv,P,S,W,D", [
    (4, 4, 4, 1, 2, 12, 64),  # MHA, a c2i prompt
    (5, 4, 2, 5, 3, 9, 100),  # GQA, head_dim 100, a longer prompt
    (3, 8, 1, 1, 0, 7, 128),  # MQA, no sinks, head_dim 128 (fewer rows than a block of 4)
    (1, 2, 2, 1, 1, 6, 64),  # one row
    (2, 4, 2, 70, 2, 9, 64),  # a long prompt: past ring.MERGED_ROWS in one tile, so three tiles even merged
])
def test_ring_kernel_writes_and_matches_reference(poisoned_empty, launch, B, H, Hkv, P, S, W, D):
    g = torch.Generator().manual_seed(B * 1000 + W * 10 + D)
    offsets = random_offsets(g, H, 6, W)
    # one position per row: the first image position, the last sink, random, far past the window
    pos = row_positions(g, B, P, P + 4 * W, [P, P + max(S - 1, 0), P + 4 * W][:B])
    for p in (pos, pos[-1]):  # per row, then one position for every row
        inputs, (want, *want_bufs) = random_ring_case(B, H, Hkv, P, S, W, D, offsets, p, torch.float32,
                                                      int(p.sum()), DEVICE)
        got = ring_decode_attention(*inputs, S, launch=launch)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), want, **TOL)
        _same([t.cpu() for t in inputs[3:9]], want_bufs)


@pytest.mark.parametrize("launch", [None, dict(rows_per_program=2, late_cast=True, early_loads=False),
                                    dict(merged=False)], ids=["engine", "rows2-late-wait-first", "three-tiles"])
@pytest.mark.parametrize("B,H,Hkv,P,S,W,D", [(4, 4, 4, 1, 2, 12, 64), (5, 4, 2, 5, 3, 9, 100), (3, 8, 1, 1, 0, 7, 128)])
def test_ring_kernel_remainder_entry_matches_reference(poisoned_empty, launch, B, H, Hkv, P, S, W, D):
    """rest_sums: random running sums, rows at positions with and without a remainder (the first image
    position and the last sink have none); unread ring entries are NaN, the output starts NaN."""
    g = torch.Generator().manual_seed(B * 7 + D)
    offsets = random_offsets(g, H, 5, W)
    pos = row_positions(g, B, P, P + 4 * W, [P, P + max(S - 1, 0), P + 4 * W])
    inputs, _ = random_ring_case(B, H, Hkv, P, S, W, D, offsets, pos, torch.float32, int(pos.sum()) + 1, DEVICE)
    sums = tuple(torch.randn(B, Hkv, D, generator=g).mul_(5).to(DEVICE) for _ in range(2))
    bufs = [t.cpu().clone() for t in inputs[3:9]]
    want = ring_decode_attention_ref(*[t.cpu() for t in inputs[:3]], *bufs, offsets, pos, S,
                                     rest_sums=[t.cpu() for t in sums])
    plain = ring_decode_attention_ref(*[t.cpu() for t in inputs[:3]], *[t.cpu().clone() for t in inputs[3:9]],
                                      offsets, pos, S)
    got = ring_decode_attention(*inputs, S, rest_sums=sums, launch=launch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, **TOL)
    _same([t.cpu() for t in inputs[3:9]], bufs)
    if S:  # rows 0 and 1 (the first image position, the last sink) read every image key so far
        assert (want[:2] - plain[:2]).abs().max() < 1e-6
    assert (want[2] - plain[2]).abs().max() > 1e-2  # row 2, far past the window, has a remainder
    with pytest.raises(ValueError, match="rest_sums' k_sum must be fp32"):
        ring_decode_attention(*inputs, S, rest_sums=(sums[0].half(), sums[1]))


@pytest.mark.parametrize("launch", [None, dict(merged=False, late_cast=True),
                                    dict(rows_per_program=2, early_loads=False)],
                         ids=["engine", "three-tiles-late", "rows2-wait-first"])
@pytest.mark.parametrize("B,H,Hkv,P,S,W,D,dtype", [
    (4, 4, 4, 1, 2, 12, 64, torch.float32),  # MHA, one table per row
    (3, 4, 2, 5, 3, 9, 100, torch.bfloat16),  # GQA, head_dim 100 (a masked tail of the pairs)
    (2, 2, 1, 1, 0, 7, 128, torch.float32),  # MQA, no sinks
])
def test_ring_kernel_rotates_q_and_k_as_apply_rope(poisoned_empty, launch, B, H, Hkv, P, S, W, D, dtype):
    """rope=: q and the new key arrive unrotated, as strided views of one projection output (B, H + 2 Hkv,
    D), and the kernel rotates them. Output and written buffers (the rotated key in the ring and the
    sinks) == the reference's on inputs rotated beforehand by the model's apply_rope, with tables of
    random angles, one per row and one shared."""
    from arsparse.models.rope import apply_rope

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(3), "little"))
    offsets = random_offsets(g, H, 6, W)
    pos = row_positions(g, B, P, P + 4 * W, [P, P + max(S - 1, 0), P + 4 * W][:B])
    inputs, _ = random_ring_case(B, H, Hkv, P, S, W, D, offsets, pos, dtype, int(pos.sum()), DEVICE)
    qkv = torch.randn(B, H + 2 * Hkv, D, generator=g).to(dtype)  # the projection's output, one position
    q, k_new = qkv[:, :H], qkv[:, H:H + Hkv]  # (B, H, D), (B, Hkv, D) views with the row stride of qkv
    v_new = inputs[2]
    # bf16: the interpreter's casts truncate, so its rotated q and k may sit one unit in the last place
    # from PyTorch's (rounded) ones, which the softmax carries into the output
    tol = TOL if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)
    for rows in (B, 1):
        angle = torch.rand(rows, D // 2, generator=g) * 6.3
        table = torch.stack([angle.cos(), angle.sin()], -1)  # (rows, D/2, 2) cos/sin of random angles
        rot = lambda x: apply_rope(x[:, None], table if rows == 1 else table[:, None])[:, 0]  # noqa: E731
        bufs = [t.cpu().clone() for t in inputs[3:9]]
        want = ring_decode_attention_ref(rot(q), rot(k_new), v_new.cpu(), *bufs, offsets, pos, S)
        fresh = [t.clone() for t in inputs[3:9]]
        got = ring_decode_attention(q.to(DEVICE), k_new.to(DEVICE), v_new, *fresh, offsets.to(DEVICE),
                                    pos.to(DEVICE), S, rope=table.to(DEVICE), launch=launch)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), want, **tol)
        if DEVICE == "cpu" and dtype == torch.float32:  # the interpreter's fp32 rotation is PyTorch's (no
            _same([t.cpu() for t in fresh], bufs)  # fused multiply-adds); its casts to bf16 truncate
        else:
            for t, w in zip(fresh, bufs):
                torch.testing.assert_close(t.cpu(), w, equal_nan=True, **tol)
    with pytest.raises(ValueError, match="rope table must be contiguous fp32"):
        ring_decode_attention(*inputs, S, rope=table.double())
    with pytest.raises(ValueError, match="need update_sums=True"):
        sums = tuple(torch.zeros(B, Hkv, D, device=DEVICE) for _ in range(2))
        ring_decode_attention(*inputs, S, rope=table.to(DEVICE), rest_sums=sums)


@pytest.mark.parametrize("launch", [None, dict(merged=False, late_cast=True),
                                    dict(rows_per_program=2, early_loads=False)],
                         ids=["engine", "three-tiles-late", "rows2-wait-first"])
@pytest.mark.parametrize("B,H,P,S,W,D,rotate", [
    (4, 4, 1, 2, 12, 64, True),  # a c2i prompt, q and k rotated in the kernel
    (3, 2, 5, 3, 9, 100, False),  # head_dim 100, q and k rotated beforehand
    (3, 4, 1, 0, 7, 128, True),  # no sinks: every row adds its token
])
def test_ring_kernel_adds_the_new_token_to_the_remainder_sums(poisoned_empty, launch, B, H, P, S, W, D, rotate):
    """update_sums=True (one query head per kv head): the running sums arrive without the new token.
    The output == the reference's given the sums with the (rotated) new token added where it is past
    the sinks, and the kernel stores exactly those sums (rows at the first image position and the
    last sink leave theirs as they were)."""
    from arsparse.models.rope import apply_rope

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(3), "little"))
    offsets = random_offsets(g, H, 5, W)
    pos = row_positions(g, B, P, P + 4 * W, [P, P + max(S - 1, 0), P + 4 * W])
    inputs, _ = random_ring_case(B, H, H, P, S, W, D, offsets, pos, torch.float32, int(pos.sum()) + 3, DEVICE)
    q, k_new, v_new = (t.cpu() for t in inputs[:3])
    table = None
    if rotate:
        angle = torch.rand(B, D // 2, generator=g) * 6.3
        table = torch.stack([angle.cos(), angle.sin()], -1)  # (B, D/2, 2)
        q, k_rot = (apply_rope(x[:, None], table[:, None])[:, 0] for x in (q, k_new))
    else:
        k_rot = k_new
    sums = [torch.randn(B, H, D, generator=g).mul_(5) for _ in range(2)]
    past = (pos - P >= S).to(torch.float32)[:, None, None]  # (B, 1, 1)
    want_sums = [sums[0] + k_rot * past, sums[1] + v_new * past]
    bufs = [t.cpu().clone() for t in inputs[3:9]]
    want = ring_decode_attention_ref(q, k_rot, v_new, *bufs, offsets, pos, S, rest_sums=want_sums)
    got_sums = [t.clone().to(DEVICE) for t in sums]
    got = ring_decode_attention(*inputs, S, rest_sums=got_sums, update_sums=True, launch=launch,
                                rope=None if table is None else table.to(DEVICE))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, **TOL)
    if DEVICE == "cpu":  # (the interpreter's fp32 rotation is PyTorch's: the same bits)
        _same([t.cpu() for t in inputs[3:9] + got_sums], bufs + want_sums)
    else:
        for t, w in zip(inputs[3:9] + got_sums, bufs + want_sums):
            torch.testing.assert_close(t.cpu(), w, equal_nan=True, **TOL)
    assert not torch.equal(want_sums[0], sums[0])  # row 2, far past the sinks, added its token
    if S:
        assert torch.equal(got_sums[0][:2].cpu(), sums[0][:2])  # rows 0 and 1 are not past the sinks
    with pytest.raises(ValueError, match=f"one query head per kv head, got H={H}, Hkv=1"):
        mqa = torch.zeros(B, 1, D, device=DEVICE)  # (the same step with one kv head for the H query heads)
        ring_decode_attention(inputs[0], *[t[:, :1] for t in inputs[1:9]], *inputs[9:], S,
                              rest_sums=(mqa, mqa.clone()), update_sums=True)
    with pytest.raises(ValueError, match="needs rest_sums="):
        ring_decode_attention(*inputs, S, update_sums=True)


@pytest.mark.parametrize("launch", [None, dict(merged=False)], ids=["engine", "three-tiles"])
def test_ring_kernel_offsets_past_int32_read_nothing(poisoned_empty, launch):
    """The kernel computes positions in 32 bits: an offset of 2**31 or more (past any position) reads
    nothing, as the reference says, rather than wrapping onto a near offset or the new token."""
    B, H, Hkv, P, S, W, D = 2, 2, 2, 2, 3, 5, 16
    offsets = torch.tensor([[2**32, 1, 3], [2**32 + 1, 2**31, 0]])
    pos = torch.tensor([P + 3 * W, P + 4])
    inputs, (want, *want_bufs) = random_ring_case(B, H, Hkv, P, S, W, D, offsets, pos, torch.float32,
                                                  int.from_bytes(os.urandom(3), "little"), DEVICE)
    got = ring_decode_attention(*inputs, S, launch=launch)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    _same([t.cpu() for t in inputs[3:9]], want_bufs)


ROW_BLOCKS = [dict(late_cast=True, num_warps=2), dict(rows_per_program=2, num_stages=2),
              dict(rows_per_program=3, late_cast=True), dict(rows_per_program=8, num_warps=4),
              dict(rows_per_program=3, heads_first=True), dict(rows_per_program=3, merged=False, late_cast=True),
              dict(rows_per_program=2, programs=5), dict(rows_per_program=3, heads_first=True, programs=4)]


@pytest.mark.parametrize("launch", ROW_BLOCKS, ids=["late", "rows2", "rows3-late", "rows8", "rows3-heads-first",
                                                    "rows3-three-tiles-late", "rows2-programs5",
                                                    "rows3-heads-first-programs4"])
@pytest.mark.parametrize("B,H,Hkv,P,S,W,D,dtype", [
    (4, 6, 6, 1, 2, 12, 64, torch.float32),  # MHA, 6 heads: blocks of 4 and 5 leave a part-block
    (3, 8, 2, 5, 3, 9, 32, torch.bfloat16),  # GQA 4: blocks of 3 and 5 span kv heads and their writers
    (3, 6, 3, 3, 0, 7, 100, torch.bfloat16),  # GQA 2, no sinks, head_dim 100 (a masked tail)
])
def test_ring_kernel_row_blocks_match_reference(poisoned_empty, launch, B, H, Hkv, P, S, W, D, dtype):
    """launch=: blocks of rows per program (3 and 8 leave a part-block of B rows), cache-dtype tiles,
    a position per row; then
    with a caption span (the padded prompt NaN) and the remainder entry. Output and written buffers
    == the reference's."""
    g = torch.Generator().manual_seed(B * 100 + H * 10 + D)
    offsets = random_offsets(g, H, 6, W)
    pos = row_positions(g, B, P, P + 4 * W, [P, P + max(S - 1, 0), P + 4 * W])
    tol = TOL if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    inputs, (want, *want_bufs) = random_ring_case(B, H, Hkv, P, S, W, D, offsets, pos, dtype, int(pos.sum()), DEVICE)
    fresh = [t.clone() for t in inputs]  # for the second call
    got = ring_decode_attention(*inputs, S, launch=launch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, **tol)
    _same([t.cpu() for t in inputs[3:9]], want_bufs)

    span = random_span(g, B, P)
    for t in fresh[3:5]:  # the prompt's padded keys and values
        for b in range(B):
            t[b, :, : span[b, 0]] = float("nan")
            t[b, :, span[b, 1]:] = float("nan")
    sums = tuple(torch.randn(B, Hkv, D, generator=g).mul_(5) for _ in range(2))
    bufs = [t.cpu().clone() for t in fresh[3:9]]
    want = ring_decode_attention_ref(*[t.cpu() for t in fresh[:3]], *bufs, offsets, pos, S, prompt_span=span,
                                     rest_sums=sums)
    got = ring_decode_attention(*fresh, S, launch=launch, prompt_span=span.to(DEVICE),
                                rest_sums=[t.to(DEVICE) for t in sums])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, **tol)
    _same([t.cpu() for t in fresh[3:9]], bufs)


#: What a build with programmatic dependent launch (``PDL``, kernels/triton/_pdl.py) must hold in its PTX.
PDL_PTX = ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]


def test_dense_kernel_compiles_for_hopper():
    """The split and combine kernels' builds for sm_90 (see conftest.compile_for_hopper): the engine's,
    and with programmatic dependent launch (their PTX must hold its instructions)."""
    pointers = dict(POS="*i64", SPAN="*i32", O_PART="*fp32", M_PART="*fp32", L_PART="*fp32",
                    **{n: "*bf16" for n in ("Q", "KN", "VN", "K", "V", "OUT")})
    base = dict(G=1, BLOCK_G=1, BLOCK_N=128, BLOCK_D=64, DIRECT=True, HAS_SPAN=False)
    builds = {"engine": (base, 2),
              "small-tiles-pdl": (dict(base, BLOCK_N=64, DIRECT=False, PDL=True), 2,
                                  PDL_PTX + ["ld.global before wait <= 0"]),
              "gqa-span-d128": (dict(base, G=4, BLOCK_G=4, BLOCK_N=32, BLOCK_D=128, DIRECT=False, HAS_SPAN=True), 4),
              "prefetch-64": (dict(base, BLOCK_N=64, PREFETCH=True), 2),
              "prefetch-gqa-span-pdl": (dict(base, G=4, BLOCK_G=4, BLOCK_N=32, DIRECT=False, HAS_SPAN=True, PREFETCH=True,
                                             PDL=True), 4, PDL_PTX),
              # tensor-core products (decode.LAUNCH["dot"])
              "dot": (dict(base, BLOCK_G=16, DOT=True), 2, ["mma.sync"]),
              "dot-gqa-span-pdl": (dict(base, G=4, BLOCK_G=16, BLOCK_N=64, DIRECT=False, HAS_SPAN=True, DOT=True,
                                        PDL=True), 4, PDL_PTX + ["mma.sync"])}
    compile_for_hopper("arsparse.kernels.triton._decode", "decode_split_kernel", pointers, builds)
    combine = {"engine": (dict(BLOCK_S=8, BLOCK_D=64), 4), "pdl": (dict(BLOCK_S=8, BLOCK_D=64, PDL=True), 4, PDL_PTX)}
    compile_for_hopper("arsparse.kernels.triton._decode", "combine_kernel",
                       dict(O_PART="*fp32", M_PART="*fp32", L_PART="*fp32", OUT="*bf16"), combine)


@pytest.mark.parametrize("programs,heads_first", [(1, False), (3, True), (7, False), (40, False)])
def test_ring_kernel_programs_take_every_row_block_and_head(poisoned_empty, monkeypatch, programs, heads_first):
    """launch programs=N: a grid of N programs (fewer than the 2 x 5 (row block, head) pairs; 40 is more,
    so the 2-D grid) that take the pairs in turn, each pair's output and its new token written once,
    as the reference's, with the remainder sums updated in the kernel."""
    from arsparse.kernels.triton import ring

    B, H, P, S, W, D = 3, 5, 2, 2, 9, 32
    grids = []
    kernel = ring.ring_decode_kernel
    monkeypatch.setattr(ring, "ring_decode_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: grids.append(grid) or kernel[grid]})())
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(3), "little"))
    offsets = random_offsets(g, H, 6, W)
    pos = row_positions(g, B, P, P + 4 * W, [P + S, P + 4 * W])
    inputs, _ = random_ring_case(B, H, H, P, S, W, D, offsets, pos, torch.float32, int(pos.sum()), DEVICE)
    sums = [torch.randn(B, H, D, generator=g).mul_(5) for _ in range(2)]
    past = (pos - P >= S).to(torch.float32)[:, None, None]  # (B, 1, 1)
    want_sums = [sums[0] + inputs[1].cpu() * past, sums[1] + inputs[2].cpu() * past]
    bufs = [t.cpu().clone() for t in inputs[3:9]]
    want = ring_decode_attention_ref(*[t.cpu() for t in inputs[:3]], *bufs, offsets, pos, S, rest_sums=want_sums)
    got_sums = [t.clone().to(DEVICE) for t in sums]
    got = ring_decode_attention(*inputs, S, rest_sums=got_sums, update_sums=True,
                                launch=dict(programs=programs, heads_first=heads_first, rows_per_program=2))
    assert grids == [(programs,) if programs < 10 else ((H, 2) if heads_first else (2, H))]
    torch.testing.assert_close(got.cpu(), want, **TOL)
    _same([t.cpu() for t in inputs[3:9]], bufs)
    for t, w in zip(got_sums, want_sums):
        torch.testing.assert_close(t.cpu(), w, **TOL)


def test_ring_launch_settings_parse_and_reject_bad_ones():
    from arsparse.kernels.triton import ring

    got = ring.parse_launch("rows_per_program=4, late_cast=true,num_warps=8")
    assert got == dict(ring.LAUNCH, rows_per_program=4, late_cast=True, num_warps=8)
    assert ring.parse_launch("") == ring.LAUNCH and ring.parse_launch("late_cast=0")["late_cast"] is False
    for text, msg in (("rows=2", r"unknown ring launch settings \['rows'\]"), ("num_warps=3", "1, 2, 4, 8 or 16"),
                      ("num_warps", "KEY=VALUE"), ("late_cast=yes", "late_cast takes 1, 0, true or false"),
                      ("rows_per_program=two", "takes an integer"), ("rows_per_program=0", "an int >= 1"),
                      ("programs=-1", "programs=-1 is invalid: must be an int >= 0")):
        with pytest.raises(ValueError, match=msg):
            ring.parse_launch(text)
    assert ring.parse_launch("programs=264")["programs"] == 264


def test_merged_ring_tile_alignment_is_the_common_power_of_two_of_addresses_and_strides():
    """The alignment the merged kernel restates for its gathered rows: the largest power of two up to 16
    bytes dividing every buffer's address and every stride but the last (a direct gcd), on views at
    random element offsets and head sizes."""
    import math

    from arsparse.kernels.triton.ring import _row_alignment

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for _ in range(20):
        D = int(torch.randint(1, 5, (1,), generator=g)) * [1, 2, 4, 8, 16][int(torch.randint(0, 5, (1,), generator=g))]
        dtype = [torch.float32, torch.bfloat16][int(torch.randint(0, 2, (1,), generator=g))]
        views = []
        for _ in range(3):
            base = torch.empty(2 * 3 * 5 * D + 16, dtype=dtype)
            start = int(torch.randint(0, 16, (1,), generator=g))
            views.append(base[start:start + 2 * 3 * 5 * D].view(2, 3, 5, D))
        values = [v for t in views for v in (t.data_ptr(), *(st * t.element_size() for st in t.stride()[:-1]))]
        common = math.gcd(*values)
        assert _row_alignment(*views) == min(16, common & -common)


def test_caches_past_32_bit_offsets_are_refused():
    from arsparse.kernels.triton.decode import check_offsets_fit

    check_offsets_fit(k=torch.empty(2**15, 2**16, device="meta"))  # farthest element 2**31 - 1: fits
    with pytest.raises(ValueError, match="k_cache spans 2,147,581,953 elements, past the 2\\*\\*31"):
        check_offsets_fit(k_cache=torch.empty(2**15 + 1, 2**16 + 1, device="meta"))
    wide = torch.empty(2, 4, 8, 64).as_strided((2, 4, 8, 64), (0, 0, 0, 1))  # strides, not sizes, set the extent
    check_offsets_fit(v=wide)


def test_ring_kernel_rejects_bad_input():
    B, H, D = 2, 4, 64
    q, new = torch.randn(B, H, D), torch.randn(B, H, D)
    pk, sk, rk = torch.randn(B, H, 1, D), torch.randn(B, H, 3, D), torch.randn(B, H, 5, D)
    offs = torch.zeros(H, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="fewer than n_sinks=4"):
        ring_decode_attention(q, new, new, pk, pk, sk, sk, rk, rk, offs, torch.tensor(3), 4)
    with pytest.raises(ValueError, match="offsets must be an int64"):
        ring_decode_attention(q, new, new, pk, pk, sk, sk, rk, rk, offs.int(), torch.tensor(3), 2)
    with pytest.raises(ValueError, match="v_new must have the cache's dtype"):
        ring_decode_attention(q, new, new.double(), pk, pk, sk, sk, rk, rk, offs, torch.tensor(3), 2)
    with pytest.raises(ValueError, match="prompt and the ring need at least one position"):
        ring_decode_attention(q, new, new, pk[:, :, :0], pk[:, :, :0], sk, sk, rk, rk, offs, torch.tensor(3), 2)
    with pytest.raises(ValueError, match=r"unknown launch settings \['heads'\]"):
        ring_decode_attention(q, new, new, pk, pk, sk, sk, rk, rk, offs, torch.tensor(3), 2, launch=dict(heads=2))
    with pytest.raises(ValueError, match="rows_per_program=0 is invalid: must be an int >= 1"):
        ring_decode_attention(q, new, new, pk, pk, sk, sk, rk, rk, offs, torch.tensor(3), 2,
                              launch=dict(rows_per_program=0))
    with pytest.raises(ValueError, match="late_cast=1 is invalid: must be a bool"):
        ring_decode_attention(q, new, new, pk, pk, sk, sk, rk, rk, offs, torch.tensor(3), 2, launch=dict(late_cast=1))
    with pytest.raises(ValueError, match="num_warps=3 is invalid"):
        ring_decode_attention(q, new, new, pk, pk, sk, sk, rk, rk, offs, torch.tensor(3), 2, launch=dict(num_warps=3))


# ---- the caches and the engine through the kernels --------------------------------------------

def _ring_buffers(cache, layer):
    """The ring cache's state the step may change (the scratch sink slot is the torch path's alone)."""
    return [cache.pk[layer], cache.pv[layer], cache.rk[layer], cache.rv[layer],
            cache.sk[layer, :, :, : cache.S], cache.sv[layer, :, :, : cache.S]]


@pytest.mark.parametrize("policy,G,P", [
    (dict(name="diagonal", local=3, rows=2, band=1, sinks=2), 1, 1),
    (dict(name="streaming", sinks=3, recent=7), 2, 5),  # GQA, a 5-token prompt
    (dict(name="diagonal", local=1, rows=3, band=0, sinks=0), 1, 3),  # no sinks
    (dict(name="diagonal", local=2, rows=1, band=1, sinks=2, remainder=True), 2, 1),  # the remainder entry
    (dict(name="streaming", sinks=0, recent=4, remainder=True), 1, 3),
])
def test_ring_cache_triton_step_equals_torch_step(policy, G, P):
    """Every decode step of a random sequence: the Triton ring cache's output and buffers == the
    PyTorch ring cache's (the reference path)."""
    import arsparse.policies as policies
    from arsparse.models.config import gpt_config

    cfg = gpt_config("GPT-tiny", image_tokens=25, n_head=4, n_kv_head=4 // G, cls_token_num=P, n_layer=1)
    pol = policies.get(**policy)
    ref = pol.make_cache(cfg, 2, torch.float32, DEVICE, kernel="torch")
    fast = pol.make_cache(cfg, 2, torch.float32, DEVICE, kernel="triton")
    g = torch.Generator().manual_seed(P * 10 + G)
    D, Hkv = cfg.head_dim, cfg.kv_heads
    pk, pv = (torch.randn(2, Hkv, P, D, generator=g).to(DEVICE) for _ in range(2))
    qp = torch.randn(2, 4, P, D, generator=g).to(DEVICE)
    for c in (ref, fast):
        c.phase = "prefill"
        c.attend(0, qp, pk, pv)
        c.phase = "decode"
        c.pos.fill_(P)
    for step in range(24):
        q = torch.randn(2, 4, 1, D, generator=g).to(DEVICE)
        k, v = (torch.randn(2, Hkv, 1, D, generator=g).to(DEVICE) for _ in range(2))
        torch.testing.assert_close(fast.attend(0, q, k, v), ref.attend(0, q, k, v), **TOL)
        _same(_ring_buffers(fast, 0) + [fast.ksum, fast.vsum], _ring_buffers(ref, 0) + [ref.ksum, ref.vsum])
        ref.pos.add_(1)
        fast.pos.add_(1)


@pytest.mark.parametrize("model_type,matvec,remainder", [("c2i", False, 0), ("t2i", False, 0), ("c2i", True, 0),
                                                          ("c2i", False, 1)],
                         ids=["c2i", "t2i", "c2i-matvec", "c2i-remainder"])
def test_ring_kernel_rotating_q_and_k_gives_the_reference_tokens(monkeypatch, model_type, matvec, remainder):
    """On the fused path (the PyTorch halves, as compiled on a GPU) a ring policy's decode steps hand q
    and k to the Triton ring kernel unrotated with the step's RoPE table (one per row for t2i), and the
    kernel rotates them: the tokens equal the reference path's (RoPE in the model, gathered attention).
    With the remainder entry the kernel also adds the rotated key to the running sums.
    The matvec halves fold RoPE into their wqkv launch and hand over rotated q and k (no table)."""
    from arsparse import Generator
    from arsparse.kernels import triton as kernels
    from conftest import random_cond, random_gpt

    model = random_gpt(model_type, seed=6)
    cond = random_cond(model, 2)
    policy = f"diagonal:local=3,rows=1,band=1,sinks=2,remainder={remainder}"
    kw = dict(cfg_scale=2.0, temperature=1.0, seed=int.from_bytes(os.urandom(2), "little"))
    want = Generator(model, device=DEVICE, dtype="fp32", kernel="torch", policy=policy).sample_tokens(cond, **kw)
    tables = []
    real = kernels.ring_decode_attention

    def recording(*a, rope=None, **k):
        tables.append(rope)
        return real(*a, rope=rope, **k)

    monkeypatch.setattr(kernels, "ring_decode_attention", recording)
    gen = Generator(model, device=DEVICE, dtype="fp32", kernel="triton", policy=policy, matvec=matvec)
    if not matvec:
        model.fuse(None)  # (the compiled path's halves, uncompiled)
    try:
        got = gen.sample_tokens(cond, **kw)
    finally:
        model.unfuse()
    assert torch.equal(got, want)
    cfg = model.config
    n = (cfg.image_tokens - 1) * cfg.n_layer  # every decode step's layers, not the prefill (CUDA graphs
    assert len(tables) == n if DEVICE == "cpu" else 0 < len(tables) < n  # replay the steps they captured)
    if matvec:
        assert all(t is None for t in tables)
    else:
        assert all(t is not None and t.shape[-2:] == (cfg.head_dim // 2, 2) for t in tables)


@pytest.mark.parametrize("policy,n_kv_head", [(None, 2), ("diagonal", None), ("streaming", 1), ("remainder", 2)])
def test_row_caches_triton_step_equals_torch_step(policy, n_kv_head):
    """The continuous-batching caches: rows at random positions of their own (the first image
    position, the last, others), a batch narrower than the cache; Triton == PyTorch, output and
    buffers (the remainder's running sums too), over several steps."""
    from arsparse import policies
    from arsparse.engine.continuous import make_row_cache
    from conftest import random_gpt

    cfg = random_gpt("t2i", image_tokens=36, n_kv_head=n_kv_head).config  # a 5-token prompt
    args = dict(diagonal=("diagonal", dict(local=2, rows=2, band=1, sinks=2)),
                streaming=("streaming", dict(sinks=1, recent=4)),
                remainder=("diagonal", dict(local=2, rows=1, band=1, sinks=2, remainder=True)))
    pol = policies.get(args[policy][0], **args[policy][1]) if policy else None
    rows, B, P = 6, 5, cfg.cls_token_num
    caches = {k: make_row_cache(pol, cfg, rows, torch.float32, DEVICE, kernel=k) for k in ("torch", "triton")}
    g = torch.Generator().manual_seed(7)
    state = ["k", "v"] if pol is None else ["pk", "pv", "rk", "rv"] + (["ksum", "vsum"] if pol.remainder else [])
    for name in state:  # the same random history in both, every entry finite
        buf = torch.randn(getattr(caches["torch"], name).shape, generator=g).to(DEVICE)
        for c in caches.values():
            getattr(c, name).copy_(buf)
    if pol is not None:
        sinks = torch.randn(caches["torch"].sk.shape, generator=g).to(DEVICE)
        for c in caches.values():
            c.sk.copy_(sinks)
            c.sv.copy_(sinks.flip(-1))
    last = cfg.seq_len - 1
    pos = row_positions(g, rows, P, last, [P, last, P + 1, last - 1]).to(DEVICE)
    for c in caches.values():
        c.phase = "decode"
        c.pos.copy_(pos)
    D, H, Hkv = cfg.head_dim, cfg.n_head, cfg.kv_heads
    for step in range(3):
        q = torch.randn(B, H, 1, D, generator=g).to(DEVICE)
        k, v = (torch.randn(B, Hkv, 1, D, generator=g).to(DEVICE) for _ in range(2))
        for layer in range(cfg.n_layer):
            got, want = (caches[n].attend(layer, q, k, v) for n in ("triton", "torch"))
            torch.testing.assert_close(got, want, **TOL)
            pick = (lambda c: [c.k[layer], c.v[layer]]) if pol is None else (lambda c: _ring_buffers(c, layer))
            _same(pick(caches["triton"]), pick(caches["torch"]))
            if pol is not None and pol.remainder:
                _same([caches["triton"].ksum[layer], caches["triton"].vsum[layer]],
                      [caches["torch"].ksum[layer], caches["torch"].vsum[layer]])
        for c in caches.values():  # advance; a row past the end starts a new image
            c.pos.copy_(torch.where(c.pos < last, c.pos + 1, P))


@pytest.mark.parametrize("policy", [None, dict(local=2, rows=2, band=1, sinks=1)])
def test_generator_triton_equals_torch(policy):
    """The whole engine on a tiny model (3x3 image): teacher-forced logits and sampled tokens with
    guidance, Triton == PyTorch."""
    from arsparse import policies
    from arsparse.engine.generator import Generator
    from conftest import random_cond, random_gpt

    model = random_gpt("c2i", image_tokens=9, seed=9, n_kv_head=2)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.image_tokens))
    pol = policies.get("diagonal", **policy) if policy else None
    gens = {k: Generator(model, device=DEVICE, dtype="fp32", kernel=k, policy=pol) for k in ("torch", "triton")}
    logits = {k: gen.cached_logits(cond, tokens) for k, gen in gens.items()}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    sampled = {k: gen.sample_tokens(cond[:1], cfg_scale=2.0, seed=5) for k, gen in gens.items()}
    assert torch.equal(sampled["triton"], sampled["torch"])


_DIAGONAL = dict(local=2, rows=1, band=1, sinks=1)


@pytest.mark.parametrize("policy,fused", [(None, False), (_DIAGONAL, False), (dict(_DIAGONAL, remainder=True), False),
                                          (_DIAGONAL, True), (dict(_DIAGONAL, remainder=True), True)],
                         ids=["dense", "diagonal", "remainder", "diagonal-fused", "remainder-fused"])
def test_continuous_batching_through_triton_gives_the_offline_tokens(monkeypatch, policy, fused):
    """The serving engine's slots, each at its own position, through the Triton kernels: every
    request gets the offline PyTorch generator's tokens, whether it joined mid-flight or not.
    ``fused``: the compiled model's halves (uncompiled), which hand the ring kernel q and k unrotated
    with each row's RoPE table."""
    from arsparse import policies
    from arsparse.engine.continuous import SlotDecoder
    from arsparse.engine.generator import Generator
    from arsparse.kernels import triton as kernels
    from conftest import random_gpt
    from test_serve_engine import _offline, _requests, _serve

    model = random_gpt("c2i", image_tokens=9, seed=2, n_head=2)
    pol = policies.get("diagonal", **policy) if policy else None
    offline = Generator(model, device=DEVICE, dtype="fp32", kernel="torch", policy=pol)
    dec = SlotDecoder(Generator(model, device=DEVICE, dtype="fp32", kernel="triton", policy=pol), slots=3,
                      guidance=True)
    tables = []
    real = kernels.ring_decode_attention
    monkeypatch.setattr(kernels, "ring_decode_attention",
                        lambda q, *a, rope=None, **k: tables.append((rope, q.shape[0])) or real(q, *a, rope=rope, **k))
    reqs = _requests(model, 3, seed=4)
    if fused:
        model.fuse(None)
    try:
        results, joined = _serve(dec, reqs, [0, 3, 5])
    finally:
        model.unfuse()
    assert joined >= 1
    for i, r in enumerate(reqs):
        assert torch.equal(results[i], _offline(offline, r)), f"request {i}"
    if fused:  # every ring launch rotated, with one table per row
        D = model.config.head_dim
        assert tables and all(t is not None and t.shape == (rows, D // 2, 2) for t, rows in tables)


RING_BUILDS = {  # constexprs and warps of the builds the compile check makes (the engine's: MERGED, ALIGN 16,
    # HAS_ROPE)
    "engine": (dict(G=1, ROWS=1, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=False, LATE_CAST=False,
                    HEADS_FIRST=False, EARLY=True, MERGED=True, ALIGN=16, HAS_ROPE=True), 1),
    "rows4-span-rest-heads-first": (dict(G=1, ROWS=4, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=True, HAS_REST=True,
                                         LATE_CAST=False, HEADS_FIRST=True, MERGED=True, ALIGN=4), 1),
    "gqa-caption-late": (dict(G=4, ROWS=8, BLOCK_P=128, BLOCK_D=128, HAS_SPAN=True, HAS_REST=False, LATE_CAST=True,
                              HEADS_FIRST=False), 4),
    "rows3-d100-rest": (dict(G=2, ROWS=3, BLOCK_P=8, BLOCK_D=128, HAS_SPAN=False, HAS_REST=True, LATE_CAST=True,
                             HEADS_FIRST=False), 2),
    # with PDL and early_loads (the engine's) the gathers are loaded before the wait (session 9's build:
    # 279 of 289 global loads; after it only the query, the new token and the sums); without
    # early_loads only the offsets
    "engine-pdl": (dict(G=1, ROWS=1, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=False, LATE_CAST=False,
                        HEADS_FIRST=False, PDL=True, EARLY=True, MERGED=True, ALIGN=16, HAS_ROPE=True), 1,
                   PDL_PTX + ["ld.global before wait >= 200"]),
    "three-tiles-pdl": (dict(G=1, ROWS=1, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=False, LATE_CAST=False,
                             HEADS_FIRST=False, PDL=True, EARLY=True), 1, PDL_PTX + ["ld.global before wait >= 200"]),
    "pdl-wait-first": (dict(G=1, ROWS=1, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=False, LATE_CAST=False,
                            HEADS_FIRST=False, PDL=True, EARLY=False, MERGED=True, ALIGN=16), 1,
                       PDL_PTX + ["ld.global before wait <= 4"]),
    "rest-pdl-early": (dict(G=2, ROWS=1, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=True, LATE_CAST=False,
                            HEADS_FIRST=False, PDL=True, EARLY=True, MERGED=True, ALIGN=16), 1,
                       PDL_PTX + ["ld.global before wait >= 200"]),
    "engine-pdl-persistent": (dict(G=1, ROWS=1, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=False,
                                   LATE_CAST=False, HEADS_FIRST=False, PDL=True, EARLY=True, MERGED=True, ALIGN=16,
                                   HAS_ROPE=True, PERSISTENT=True), 1, PDL_PTX + ["ld.global before wait >= 200"]),
    "rows3-heads-first-persistent": (dict(G=2, ROWS=3, BLOCK_P=1, BLOCK_D=64, HAS_SPAN=False, HAS_REST=True,
                                          LATE_CAST=False, HEADS_FIRST=True, MERGED=True, ALIGN=16,
                                          PERSISTENT=True), 1),
}


def test_ring_kernel_compiles_for_hopper():
    """The kernel as the GPU compiles it (Triton -> PTX -> cubin for sm_90), without a GPU, in a
    process of its own (this module runs the interpreter): the interpreter runs Python, so this is
    what shows that the compiled form accepts the code (loop-carried values, masks, tuples) in each
    build the engine and the launch sweep use."""
    pointers = dict(OFF="*i64", POS="*i64", SPAN="*i32", KSUM="*fp32", VSUM="*fp32", ROPE="*fp32",
                    **{n: "*bf16" for n in ("Q", "KN", "VN", "PK", "PV", "SK", "SV", "RK", "RV", "OUT")})
    builds = {name: (dict(const, BLOCK_O=64, BLOCK_S=4), *rest)
              for name, (const, *rest) in RING_BUILDS.items()}
    compile_for_hopper("arsparse.kernels.triton._ring", "ring_decode_kernel", pointers, builds)
