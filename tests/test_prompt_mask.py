"""Caption padding masks of t2i prompts (LlamaGen's ``emb_masks``) through every path.

The reference is LlamaGen's rule, built here independently as an additive 0 / -inf mask over a full
forward: causal; no query reads a padded prompt key except its own position; RoPE positions are
those of the padded sequence. (Running the unpadded caption alone is not a drop-in reference: it
moves the image tokens to other positions, so other RoPE angles, and under right padding the first
image token's logits come from a padded row that reads itself.) The kernels run through the Triton
interpreter on the CPU, with NaN in the cache entries they must not read and in their output buffers.
"""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse import policies  # noqa: E402
from arsparse.cli import main  # noqa: E402
from arsparse.engine.generator import Generator, _Plan, _Runner  # noqa: E402
from arsparse.kernels.reference import decode_attention_ref, ring_decode_attention_ref, slot_decode_attention_ref  # noqa: E402
from arsparse.kernels.triton import decode_attention, ring_decode_attention, slot_decode_attention  # noqa: E402
from arsparse.prompt_mask import check_prompt_mask, pad_captions, prompt_span  # noqa: E402
from conftest import (random_cond, random_gpt, random_offsets, random_ring_case, random_slot_tables,  # noqa: E402
                      random_span, row_positions)

P = 7  # prompt tokens of the tiny t2i model
TOL = dict(atol=1e-4, rtol=1e-4)
KTOL = dict(atol=2e-5, rtol=2e-5)
NAN = float("nan")


def t2i_model(seed=0, **kw):
    return random_gpt("t2i", image_tokens=16, seed=seed, cls_token_num=P, **kw)


def random_mask(g, B: int, P: int, side: str = "left") -> torch.Tensor:
    """(B, P) bool: row b keeps a random number of real tokens (row 0 one, row 1 all but one), padded on
    ``side`` ("left", "right" or "mixed": alternating)."""
    n = torch.randint(1, P + 1, (B,), generator=g)
    n[0], n[min(1, B - 1)] = 1, P - 1
    j = torch.arange(P)
    left = (j[None] >= P - n[:, None])
    right = (j[None] < n[:, None])
    if side == "left":
        return left
    if side == "right":
        return right
    return torch.where((torch.arange(B) % 2 == 0)[:, None], left, right)


class AdditiveMaskAttention:
    """softmax(q k^T / sqrt(D) + M) v with M built as LlamaGen's generate() builds its mask:
    tril(ones) with the padded prompt columns zeroed, then the diagonal set to one."""

    def __init__(self, emb_masks: torch.Tensor, T: int):
        B, P = emb_masks.shape
        allowed = torch.tril(torch.ones(T, T)).repeat(B, 1, 1)
        allowed[:, :, :P] = allowed[:, :, :P] * emb_masks[:, None, :].float()
        eye = torch.eye(T)
        allowed = allowed * (1 - eye) + eye
        self.bias = torch.zeros(B, 1, T, T).masked_fill(allowed[:, None] == 0, float("-inf"))

    def attend(self, layer, q, k, v):
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5 + self.bias
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


def reference_logits(model, cond, tokens, mask):
    h = torch.cat([model.embed_cond(cond), model.tok_embeddings(tokens[:, :-1])], dim=1)
    T = h.shape[1]
    hidden = model.forward_hidden(h, torch.arange(T), AdditiveMaskAttention(mask, T))
    return model.head(hidden[:, P - 1:])


# ---- (a) teacher forcing == an explicit masked full forward -----------------------------------

@pytest.mark.parametrize("side,n_kv_head", [("left", None), ("right", 2), ("mixed", 1)])
def test_teacher_forcing_equals_an_explicit_additive_mask(side, n_kv_head):
    model = t2i_model(seed=1, n_kv_head=n_kv_head)
    g = torch.Generator().manual_seed(11)
    cond = random_cond(model, 4, seed=2)
    mask = random_mask(g, 4, P, side)
    tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
    with torch.no_grad():
        got = model.logits(cond, tokens, prompt_mask=mask)
        want = reference_logits(model, cond, tokens, mask)
        plain = model.logits(cond, tokens)
    torch.testing.assert_close(got, want, **TOL)
    padded = ~mask.all(1)  # every image query of a padded row feels the mask (the first logit, from
    # the last prompt row, not when that row is padded and reads the whole prompt as its own + the real ones)
    assert padded.sum() >= 2 and (got - plain)[padded, 1:].abs().amax(-1).min() > 1e-2


def test_left_padded_features_do_not_matter():
    """Under left padding every query that is not padded itself reads only real tokens: the padded
    features may be anything (LlamaGen zeroes them) without changing an image logit."""
    model = t2i_model(seed=2)
    g = torch.Generator().manual_seed(3)
    cond = random_cond(model, 3, seed=4)
    mask = random_mask(g, 3, P, "left")
    tokens = torch.randint(0, model.config.vocab_size, (3, 16), generator=g)
    other = cond.masked_fill(~mask[..., None], 0.0) + 50 * torch.randn(cond.shape, generator=g) * ~mask[..., None]
    with torch.no_grad():
        torch.testing.assert_close(model.logits(other, tokens, prompt_mask=mask),
                                   model.logits(cond, tokens, prompt_mask=mask), **TOL)


# ---- (b) the engine's cached decode == teacher forcing ----------------------------------------

POLICIES = {"dense": None, "diagonal": dict(name="diagonal", local=2, rows=1, band=1, sinks=2),
            "h2o": dict(name="h2o", rho=0.4)}


def _poison_padded_prompt(cache, mask: torch.Tensor, value: float) -> None:
    """Overwrite the cache's K/V at the padded prompt positions of every layer, row and head."""
    pad = ~mask  # (rows, P)
    for name in ("pk", "pv") if hasattr(cache, "pk") else ("k", "v"):
        buf = getattr(cache, name)[:, :, :, : mask.shape[1]]  # (L, rows, Hkv, P, D), a view
        buf[pad[None, :, None, :].expand(buf.shape[0], -1, buf.shape[2], -1)] = value


def _cached_logits(model, pol, kernel, cond, tokens, mask, poison=None):
    """Prefill with the mask, optionally poison the padded prompt entries, then decode ``tokens``."""
    run = _Runner(model, _Plan(cond.shape[0], False, 0, False, True), torch.device("cpu"), False, kernel, policy=pol)
    run.set_prompt_mask(mask)
    with torch.no_grad():
        out = [run.prefill_logits(cond)]
        if poison is not None:
            _poison_padded_prompt(run.cache, mask, poison)
        for t in range(1, tokens.shape[1]):
            run.cur.copy_(tokens[:, t - 1])
            out.append(run.step_logits())
    return torch.stack(out, 1)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_cached_decode_equals_masked_teacher_forcing_and_never_reads_padding(kernel, policy):
    """(b) token by token through the cache (prefill with the mask, then decode steps) == teacher
    forcing with the mask: dense == the explicit reference, an offset policy == its masked read sets
    in one pass, a scored policy (through either kernel) == its PyTorch cache.
    (d) after the prefill the padded prompt entries of the cache are overwritten: with NaN for
    Triton (never loaded, so the logits stay finite and right), with 1e4 for PyTorch (loaded but
    weighted by exactly 0: the logits are bitwise those of the untouched cache)."""
    model = t2i_model(seed=3, n_kv_head=2)
    pol = policies.get(**POLICIES[policy]) if POLICIES[policy] else None
    g = torch.Generator().manual_seed(5)
    cond = random_cond(model, 3, seed=6)
    mask = random_mask(g, 3, P, "mixed")
    tokens = torch.randint(0, model.config.vocab_size, (3, 16 if kernel == "torch" else 7), generator=g)
    got = _cached_logits(model, pol, kernel, cond, tokens, mask, poison=NAN if kernel == "triton" else 1e4)
    assert torch.isfinite(got).all()
    if kernel == "torch":
        assert torch.equal(got, _cached_logits(model, pol, kernel, cond, tokens, mask))
    with torch.no_grad():
        want = reference_logits(model, cond, tokens, mask) if pol is None else \
            model.logits(cond, tokens, policy=pol, prompt_mask=mask)
        plain = model.logits(cond, tokens, policy=pol)
    torch.testing.assert_close(got, want, **TOL)
    assert (want - plain).abs().max() > 1e-2
    if kernel == "triton" and policy == "dense":  # and through the public entry point
        got = Generator(model, device="cpu", kernel=kernel).cached_logits(cond, tokens, prompt_mask=mask)
        torch.testing.assert_close(got, want, **TOL)


def test_guided_sampling_masks_the_unconditional_rows_too():
    """Greedy guided tokens == the argmax of LlamaGen's guidance over teacher-forced logits where the
    null caption carries the same mask as its caption."""
    model = t2i_model(seed=4)
    g = torch.Generator().manual_seed(7)
    cond = random_cond(model, 3, seed=8)
    mask = random_mask(g, 3, P, "mixed")
    gen = Generator(model, device="cpu")
    toks = gen.sample_tokens(cond, cfg_scale=2.5, top_k=1, prompt_mask=mask)
    with torch.no_grad():
        lc = model.logits(cond, toks, prompt_mask=mask)
        lu = model.logits(model.null_cond(cond), toks, prompt_mask=mask)
        lu_plain = model.logits(model.null_cond(cond), toks)
    assert torch.equal(toks, (lu + 2.5 * (lc - lu)).argmax(-1))
    assert (lu - lu_plain).abs().max() > 1e-2  # the mask does change the unconditional rows


# ---- (c) the Triton kernels with random spans == the PyTorch reference -----------------------

@pytest.mark.parametrize("B,H,Hkv,S,D,P_,pos,splits", [
    (4, 4, 2, 300, 64, 150, "rows", 3),  # a 150-token prompt: a whole tile of padding, several splits
    (3, 4, 4, 90, 32, 7, "rows", 1),  # one split: the output written directly
    (3, 8, 1, 200, 64, 130, 180, 2),  # MQA, one position for every row
])
@pytest.mark.parametrize("launch", [{}, dict(dot=1), dict(prefetch=1, block_n=32),
                                    dict(prefetch=1, dot=1, block_n=16, small_block_n=16)],
                         ids=["", "dot", "prefetch", "prefetch-dot"])
def test_dense_kernel_skips_padded_prompt_positions(poisoned_empty, monkeypatch, B, H, Hkv, S, D, P_, pos, splits,
                                                    launch):
    from arsparse.kernels.triton import decode

    # (dot: the products on tensor cores; prefetch: the next tile loaded first; tiles of padding only)
    monkeypatch.setattr(decode, "LAUNCH", dict(decode.LAUNCH, **launch))
    g = torch.Generator().manual_seed(S + P_)
    q, k_new, v_new = (torch.randn(B, h, D, generator=g) for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    p = row_positions(g, B, P_, S - 1, [P_, S - 1, P_ + 1]) if pos == "rows" else torch.tensor(pos)
    span = random_span(g, B, P_)
    for b, pb in enumerate(p.expand(B).tolist()):
        for t in (kc, vc):
            t[b, :, pb:] = NAN  # past the position
            t[b, :, : span[b, 0]] = NAN  # padding before the caption
            t[b, :, span[b, 1]: P_] = NAN  # and after it
    want_k, want_v = kc.clone(), vc.clone()
    want = decode_attention_ref(q, k_new, v_new, want_k, want_v, p, prompt_span=span, prompt_len=P_)
    assert torch.isfinite(want).all()
    got = decode_attention(q, k_new, v_new, kc, vc, p, num_splits=splits, prompt_span=span, prompt_len=P_)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **KTOL)
    torch.testing.assert_close(kc, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("launch", [None, dict(rows_per_program=3)], ids=["engine", "rows3"])
def test_ring_kernel_skips_padded_prompt_positions(poisoned_empty, launch):
    B, H, Hkv, P_, S, W, D = 4, 4, 2, 9, 2, 8, 64
    g = torch.Generator().manual_seed(21)
    offsets = random_offsets(g, H, 5, W)
    span = random_span(g, B, P_)
    pos = row_positions(g, B, P_, P_ + 4 * W, [P_, P_ + 1, P_ + 4 * W])
    for p in (pos, pos[2]):
        inputs, _ = random_ring_case(B, H, Hkv, P_, S, W, D, offsets, p, torch.float32, int(p.sum()))
        for t in inputs[3:5]:  # the prompt's padded keys and values
            for b in range(B):
                t[b, :, : span[b, 0]] = NAN
                t[b, :, span[b, 1]:] = NAN
        want_bufs = [t.clone() for t in inputs[3:9]]
        want = ring_decode_attention_ref(*inputs[:3], *want_bufs, offsets, p, S, prompt_span=span)
        assert torch.isfinite(want).all()
        got = ring_decode_attention(*inputs, S, launch=launch, prompt_span=span)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **KTOL)
        for t, w in zip(inputs[3:9], want_bufs):
            torch.testing.assert_close(t, w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("B,H,Hkv,P_,C,D,splits", [
    (3, 4, 2, 70, 130, 64, 3),  # a 70-token prompt over two blocks of split 0, uneven splits
    (2, 8, 2, 5, 37, 32, None),
])
def test_slot_kernel_skips_padded_prompt_positions(poisoned_empty, B, H, Hkv, P_, C, D, splits):
    g = torch.Generator().manual_seed(C + P_)
    (q, pk, pv, k, v, spos), _ = random_slot_tables(B, H, Hkv, P_, C, D, torch.float32, seed=C)
    span = random_span(g, B, P_)
    want_out, want_w = slot_decode_attention_ref(q, pk, pv, k.nan_to_num(), v.nan_to_num(), spos, prompt_span=span)
    for t in (pk, pv):
        for b in range(B):
            t[b, :, : span[b, 0]] = NAN
            t[b, :, span[b, 1]:] = NAN
    out, w = slot_decode_attention(q, pk, pv, k, v, spos, num_splits=splits, prompt_span=span)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    torch.testing.assert_close(out, want_out, **KTOL)
    torch.testing.assert_close(w, want_w, atol=2e-6, rtol=1e-4)
    # with fewer prompt entries the slots weigh more than without the mask
    _, w_plain = slot_decode_attention_ref(q, pk.nan_to_num(), pv.nan_to_num(), k.nan_to_num(), v.nan_to_num(), spos)
    assert (w.sum(-1) >= w_plain.sum(-1) - 1e-6).all() and (w.sum(-1) > w_plain.sum(-1) + 1e-3).any()


def test_kernels_with_a_full_span_equal_no_span_exactly(poisoned_empty):
    """(e) at the kernel level: the masked specialisation with nothing padded gives the unmasked bits."""
    g = torch.Generator().manual_seed(8)
    B, H, Hkv, S, D, P_ = 3, 4, 2, 140, 32, 9
    full = torch.tensor([[0, P_]] * B, dtype=torch.int32)
    q, kn, vn = (torch.randn(B, h, D, generator=g) for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    pos = torch.tensor([P_, 100, S - 1])
    outs = [decode_attention(q, kn, vn, kc.clone(), vc.clone(), pos, num_splits=2, prompt_span=s, prompt_len=P_)
            for s in (None, full)]
    assert torch.equal(outs[0], outs[1])
    offsets = random_offsets(g, H, 4, 6)
    inputs, _ = random_ring_case(B, H, Hkv, P_, 2, 6, D, offsets, torch.tensor([P_, P_ + 3, P_ + 20]), torch.float32, 3)
    outs = [ring_decode_attention(*[t.clone() for t in inputs], 2, prompt_span=s) for s in (None, full)]
    assert torch.equal(outs[0], outs[1])
    tables, _ = random_slot_tables(B, H, Hkv, P_, 40, D, torch.float32, seed=9)
    outs = [slot_decode_attention(*tables, prompt_span=s) for s in (None, full)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_kernels_reject_a_bad_span():
    q, kv, pk = torch.randn(2, 4, 8), torch.randn(2, 4, 20, 8), torch.randn(2, 4, 5, 8)
    span = torch.tensor([[1, 5], [0, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="prompt_span must be a contiguous int32"):
        decode_attention(q, q, q, kv, kv, torch.tensor(10), prompt_span=span.long(), prompt_len=5)
    with pytest.raises(ValueError, match=r"prompt_span must be a contiguous int32 \(B=2, 2\)"):
        slot_decode_attention(q, pk, pk, kv, kv, torch.zeros(2, 4, 20, dtype=torch.long), prompt_span=span[:1])
    with pytest.raises(ValueError, match="prompt_len must be in 1..20"):
        decode_attention(q, q, q, kv, kv, torch.tensor(10), prompt_span=span, prompt_len=0)


# ---- (e) an all-True mask is no mask ------------------------------------------------------------

def test_all_true_mask_equals_no_mask_exactly():
    model = t2i_model(seed=6)
    cond = random_cond(model, 2, seed=12)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    full = torch.ones(2, P, dtype=torch.bool)
    gen = Generator(model, device="cpu", policy=policies.get("h2o", rho=0.5))
    with torch.no_grad():
        assert torch.equal(model.logits(cond, tokens, prompt_mask=full), model.logits(cond, tokens))
    assert torch.equal(gen.cached_logits(cond, tokens, prompt_mask=full.long()), gen.cached_logits(cond, tokens))
    assert torch.equal(gen.sample_tokens(cond, seed=3, prompt_mask=full), gen.sample_tokens(cond, seed=3))


def test_batch_padding_rows_copy_the_last_mask():
    """A masked image's tokens do not depend on its batch-mates (the bucket pads with the last row)."""
    model = t2i_model(seed=7)
    g = torch.Generator().manual_seed(13)
    cond = random_cond(model, 3, seed=14)
    mask = random_mask(g, 3, P, "mixed")
    gen = Generator(model, device="cpu")
    three = gen.sample_tokens(cond, seed=[4, 5, 6], cfg_scale=2.0, prompt_mask=mask)
    one = gen.sample_tokens(cond[1:2], seed=[5], cfg_scale=2.0, prompt_mask=mask[1:2])
    assert torch.equal(three[1], one[0])


# ---- bad input -------------------------------------------------------------------------------

def test_bad_masks_are_rejected_with_what_is_allowed():
    model = t2i_model()
    cond = random_cond(model, 2)
    tokens = torch.randint(0, 48, (2, 16))
    ok = torch.ones(2, P, dtype=torch.bool)
    ok[0, :3] = False
    gen = Generator(model, device="cpu")
    cases = [(ok[:, 1:], r"\(B, P\) = \(2, 7\)"), (ok.float(), "must be bool \\(or 0/1 integers\\)"),
             (ok.long() * 2, "values other than 0/1"), (torch.zeros(2, P, dtype=torch.bool), r"rows \[0, 1\] have no real"),
             (torch.tensor([[1, 0, 1, 1, 1, 1, 1], [1] * 7]).bool(), r"rows \[0\] are not one contiguous run")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            model.logits(cond, tokens, prompt_mask=bad)
        with pytest.raises(ValueError, match=msg):
            gen.sample_tokens(cond, prompt_mask=bad)
    c2i = random_gpt("c2i")
    with pytest.raises(ValueError, match="for text-conditional \\(t2i\\) models"):
        c2i.logits(torch.tensor([1, 2]), tokens, prompt_mask=ok)
    with pytest.raises(ValueError, match="for text-conditional"):
        Generator(c2i, device="cpu").sample_tokens([1, 2], prompt_mask=ok)
    with pytest.raises(ValueError, match="more than the model's prompt of 7"):
        pad_captions(torch.randn(1, 9, 12), None, P)


def test_check_and_pad_helpers():
    assert check_prompt_mask(torch.ones(2, 3, dtype=torch.int64), 2, 3, "t2i") is None  # all real: no mask
    m = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 0]]).bool()
    assert torch.equal(prompt_span(m), torch.tensor([[2, 4], [0, 3], [1, 3]], dtype=torch.int32))
    feats = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2) + 1
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # T5's right padding
    left, lm = pad_captions(feats, mask, 5)
    assert torch.equal(lm, torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]).bool())
    assert torch.equal(left[0, 3:], feats[0, :2]) and torch.equal(left[1, 4], feats[1, 0])
    assert (left[~lm] == 0).all()  # padded features zeroed, as LlamaGen's sampler does
    right, rm = pad_captions(feats, mask, 5, left_padding=False)
    assert torch.equal(rm, torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]).bool())
    assert torch.equal(right[0, :2], feats[0, :2]) and (right[~rm] == 0).all()
    again, am = pad_captions(left, lm, 5)  # already left-padded: unchanged
    assert torch.equal(again, left) and torch.equal(am, lm)


# ---- the command line ----------------------------------------------------------------------------

def _t2i_checkpoints(tmp_path):
    from arsparse.checkpoint import save_safetensors
    from arsparse.loading import config_metadata
    from arsparse.models.vq import VQModel, vq_config

    gpt = t2i_model(seed=8)
    save_safetensors(gpt.state_dict(), tmp_path / "gpt.safetensors", config_metadata(gpt.config))
    vq = VQModel(vq_config("VQ-16", ch=32, codebook_size=48))
    save_safetensors(vq.state_dict(), tmp_path / "vq.safetensors", config_metadata(vq.config))
    return gpt, ["--gpt-ckpt", str(tmp_path / "gpt.safetensors"), "--vq-ckpt", str(tmp_path / "vq.safetensors")]


def test_generate_reads_caption_masks_and_left_pads_as_llamagen(tmp_path, capsys):
    """T5's right-padded features with emb_masks in one .npz; the same captions left-padded in a
    .safetensors with the mask in a separate file: the same images. --no-left-padding keeps T5's
    padding (other images); the Python API with the left-padded features gives the CLI's tokens."""
    import json

    import numpy as np
    from PIL import Image

    from arsparse.checkpoint import save_safetensors

    gpt, ckpt = _t2i_checkpoints(tmp_path)
    g = torch.Generator().manual_seed(15)
    feats = torch.randn(2, P, 12, generator=g)
    mask = torch.tensor([[1] * 3 + [0] * 4, [1] * 5 + [0] * 2])  # int64, as T5's tokenizer makes it
    np.savez(tmp_path / "t5.npz", caption_embs=feats.numpy(), emb_masks=mask.numpy())
    left, lm = pad_captions(feats, mask, P)
    save_safetensors({"caption_embs": left}, tmp_path / "left.safetensors")
    torch.save(lm, tmp_path / "mask.pt")
    common = ["--cfg-scale", "2", "--quiet", "--top-k", "5", "--seed", "3"]

    def images(out):
        return [np.asarray(Image.open(f)) for f in sorted((out / "images").glob("*.png"))]

    runs = {"npz": ["--caption-features", str(tmp_path / "t5.npz")],
            "split": ["--caption-features", str(tmp_path / "left.safetensors"), "--caption-mask", str(tmp_path / "mask.pt")],
            "right": ["--caption-features", str(tmp_path / "t5.npz"), "--no-left-padding"]}
    got = {}
    for name, args in runs.items():
        assert main(["generate", *ckpt, *args, *common, "--out", str(tmp_path / name)]) == 0, capsys.readouterr().err
        got[name] = images(tmp_path / name)
    assert len(got["npz"]) == 2
    assert all(np.array_equal(a, b) for a, b in zip(got["npz"], got["split"]))
    assert not all(np.array_equal(a, b) for a, b in zip(got["npz"], got["right"]))
    info = json.loads((tmp_path / "npz" / "generate.json").read_text())
    assert info["caption_tokens"] == [3, 5] and info["left_padding"] is True

    gen = Generator(gpt, device="cpu")
    tokens = gen.sample_tokens(left, cfg_scale=2.0, top_k=5, seed=[3, 4], prompt_mask=lm)
    from arsparse.tokenizers import to_pil
    from arsparse.loading import load_vq

    gen.tokenizer = load_vq(tmp_path / "vq.safetensors")
    api = [np.asarray(im) for im in to_pil(gen.decode_images(tokens))]
    assert all(np.array_equal(a, b) for a, b in zip(api, got["npz"]))

    torch.save(torch.ones(2, P + 1, dtype=torch.bool), tmp_path / "bad.pt")
    assert main(["generate", *ckpt, "--caption-features", str(tmp_path / "left.safetensors"), "--caption-mask",
                 str(tmp_path / "bad.pt"), "--out", str(tmp_path / "x")]) == 2
    assert "prompt_mask must be (B, P) = (2, 7)" in capsys.readouterr().err
    assert main(["generate", "--model", "random-small", "--caption-mask", str(tmp_path / "mask.pt"),
                 "--out", str(tmp_path / "y")]) == 2
    assert "for text-conditional (t2i) models" in capsys.readouterr().err
