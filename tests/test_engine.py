import os

import numpy as np
import pytest
import torch

from arsparse.engine.generator import Generator, bucket
from arsparse.engine.sampling import filter_logits, guide, row_key, sample, uniform_noise
from conftest import random_cond, random_gpt


def test_cached_decoding_matches_full_forward(model_type):
    model = random_gpt(model_type)
    gen = Generator(model, device="cpu")
    cond = random_cond(model, 3)
    tokens = torch.randint(0, model.config.vocab_size, (3, model.config.image_tokens))
    with torch.no_grad():
        full = model.logits(cond, tokens)
    cached = gen.cached_logits(cond, tokens)
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
    assert full.std() > 0.5  # the check is not vacuous: logits vary a lot


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_greedy_generation_follows_teacher_forced_guided_argmax(model_type, cfg_scale):
    model = random_gpt(model_type, seed=3)
    gen = Generator(model, device="cpu")
    cond = random_cond(model, 2, seed=4)
    toks = gen.sample_tokens(cond, cfg_scale=cfg_scale, top_k=1, seed=0)
    with torch.no_grad():
        lc = model.logits(cond, toks)
        lu = model.logits(model.null_cond(cond), toks)
    want = (lu + cfg_scale * (lc - lu)).argmax(-1) if cfg_scale != 1 else lc.argmax(-1)
    assert torch.equal(toks, want)
    assert gen.sample_tokens(cond, cfg_scale=cfg_scale, temperature=0.0, seed=5).equal(toks)  # T=0 is greedy too


def test_cfg_interval_switches_guidance_off():
    model = random_gpt("c2i", seed=5)
    gen = Generator(model, device="cpu")
    cond = torch.tensor([1, 2, 3])
    toks = gen.sample_tokens(cond, cfg_scale=4.0, top_k=1, cfg_interval=3)
    with torch.no_grad():
        lc = model.logits(cond, toks)
        lu = model.logits(model.null_cond(cond), toks)
    guided = (lu + 4.0 * (lc - lu)).argmax(-1)
    assert torch.equal(toks[:, :5], guided[:, :5])  # tokens 0..cfg_interval+1 guided
    assert torch.equal(toks[:, 5:], lc[:, 5:].argmax(-1))  # the rest from the cond logits alone


def test_guide_formula():
    logits = torch.randn(6, 11)
    scale = torch.tensor([1.5, 3.0, 7.0])
    active = torch.tensor([True, False, True])
    got = guide(logits, scale, active)
    for i in range(3):
        c, u = logits[i], logits[3 + i]
        want = u + scale[i] * (c - u) if active[i] else c
        torch.testing.assert_close(got[i], want)


def reference_filter(row: np.ndarray, k: int, p: float) -> np.ndarray:
    """Top-k then top-p by sorting with numpy, one row (ties kept by top-k)."""
    row = row.copy()
    if k > 0:
        kth = np.sort(row)[::-1][min(k, row.size) - 1]
        row[row < kth] = -np.inf
    if p < 1.0:
        order = np.argsort(-row, kind="stable")
        probs = np.exp(row[order] - row[order][0])
        probs /= probs.sum()
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        row[order[before > p]] = -np.inf
    return row


def test_top_k_top_p_filtering_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g) * 3
    ks = torch.tensor([0, 1, 5, 50, 3, 0, 10, 7])
    ps = torch.tensor([1.0, 0.9, 0.5, 0.3, 1.0, 0.7, 0.95, 0.05])
    got = filter_logits(logits, ks, ps, kmax=int(ks.max())).numpy()
    for i in range(8):
        want = reference_filter(logits[i].numpy().astype(np.float64), int(ks[i]), float(ps[i]))
        assert np.array_equal(np.isinf(got[i]), np.isinf(want)), i
        assert np.isfinite(got[i]).sum() >= 1


def test_gumbel_sampling_follows_the_softmax():
    """Frequencies of the counter-based Gumbel-max draws match the softmax over many steps."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 20000
    keys = torch.tensor([row_key(123, 0)])
    draws = torch.stack([sample(logits, keys, torch.tensor(s), torch.tensor([1.0])) for s in range(n)])
    freq = torch.bincount(draws.flatten(), minlength=5).float() / n
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.015, rtol=0)
    u = uniform_noise(torch.tensor([row_key(1, 0), row_key(1, 1)]), torch.tensor(0), 100000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert (u[0] - u[1]).abs().mean() > 0.2  # rows are independent streams


def test_seeded_generation_reproducible_and_batch_independent():
    model = random_gpt("c2i", seed=7)
    gen = Generator(model, device="cpu")
    cond = torch.tensor([0, 1, 2, 3])
    a = gen.sample_tokens(cond, seed=11)
    b = gen.sample_tokens(cond, seed=11)
    c = gen.sample_tokens(cond, seed=12)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.5
    # Image i of seed s does not depend on its batch-mates.
    alone = gen.sample_tokens(cond[2:3], seed=[99])
    mixed = gen.sample_tokens(torch.tensor([5, 2, 4]), seed=[1, 99, 3])
    assert torch.equal(alone[0], mixed[1])


@pytest.mark.parametrize("model_type,policy", [("c2i", None), ("t2i", "diagonal:local=3,rows=1,band=1,sinks=1")])
def test_two_half_batches_give_the_same_images(model_type, policy):
    """streams=2: the batch as two half runners (here 2 + 3 images, each its own cache; on the CPU one
    after the other) samples the tokens of one runner, per-image sampling arguments and caption masks
    going to the right half; a batch of one image runs whole."""
    from arsparse.engine.split import SplitRunner

    model = random_gpt(model_type, seed=8)
    cond = random_cond(model, 5, seed=3)
    P = model.config.cls_token_num
    mask = torch.arange(P)[None, :] >= torch.tensor([0, 2, 1, 3, 0])[:, None] if model_type == "t2i" else None
    kw = dict(cfg_scale=[1.5, 3.0, 2.0, 4.0, 1.0], temperature=[1.0, 0.7, 1.2, 1.0, 0.9], top_k=[0, 5, 0, 3, 0],
              seed=[4, 5, 6, 7, 8], prompt_mask=mask)
    one = Generator(model, device="cpu", policy=policy).sample_tokens(cond, **kw)
    gen = Generator(model, device="cpu", policy=policy, streams=2)
    assert torch.equal(gen.sample_tokens(cond, **kw), one)
    assert isinstance(gen._runner, SplitRunner) and [r.plan.batch for r in gen._runner.halves] == [2, 3]
    assert torch.equal(gen.sample_tokens(cond[3:4], **{k: v[3:4] for k, v in kw.items() if v is not None}), one[3:4])
    assert not isinstance(gen._runner, SplitRunner)
    with pytest.raises(ValueError, match="streams must be 1 or 2, got 3"):
        Generator(model, device="cpu", streams=3)


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(cfg_interval=-3), "cfg_interval"),
    (dict(seed=[1, 2]), "seed has 2 values for 3"),
    (dict(cfg_scale=float("nan")), "cfg_scale must be a finite number"),
    (dict(cfg_scale=-0.5), r"cfg_scale must be >= 0"),
    (dict(temperature=[1.0, float("inf"), 1.0]), "temperature must be a finite number"),
    (dict(top_k=2.5), "top_k must be a whole number"),
    (dict(top_k="3"), "top_k must be a finite integer"),
    (dict(seed=1.5), "seed must be a whole number"),
    (dict(seed=None), "seed must be a finite integer"),
])
def test_bad_sampling_arguments(kw, msg):
    gen = Generator(random_gpt("c2i"), device="cpu")
    with pytest.raises(ValueError, match=msg):
        gen.sample_tokens([0, 1, 2], **kw)


@pytest.mark.parametrize("cond,msg", [
    ([0, 1.5], "class labels must be a whole number"),
    (None, "class labels must be an int or a sequence of ints"),
    ("2", "class labels must be an int or a sequence of ints"),
    ([True], "class labels must be a finite integer"),
])
def test_class_labels_that_are_not_integers_are_rejected_not_truncated(cond, msg):
    gen = Generator(random_gpt("c2i"), device="cpu")
    with pytest.raises(ValueError, match=msg):
        gen.sample_tokens(cond)


def test_devices_and_kernels_that_cannot_run_here_are_named():
    gpt = random_gpt("c2i")
    with pytest.raises(ValueError, match="unknown device 'bogus': use cpu, cuda or cuda:N"):
        Generator(gpt, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available on this machine"):
            Generator(gpt, device="cuda")
        if os.environ.get("TRITON_INTERPRET") != "1":
            with pytest.raises(ValueError, match="kernel 'triton' runs on CUDA"):
                Generator(gpt, device="cpu", kernel="triton")


def test_out_of_range_class_is_rejected():
    gen = Generator(random_gpt("c2i"), device="cpu")
    with pytest.raises(ValueError, match=r"class labels must be in \[0, 6\]"):
        gen.sample_tokens([0, 7])


def test_a_tokenizer_that_cannot_decode_every_sampled_token_is_rejected():
    from arsparse.tokenizers import PaletteTokenizer

    model = random_gpt("c2i")  # vocabulary 48
    with pytest.raises(ValueError, match="decodes 32 token ids but the GPT samples from 48"):
        Generator(model, PaletteTokenizer(32), device="cpu")
    assert Generator(model, PaletteTokenizer(64), device="cpu").tokenizer.vocab_size == 64


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 200, 256, 257, 300)] == [1, 2, 4, 8, 256, 256, 320, 320]


def test_half_precision_runs_close_to_fp32():
    model = random_gpt("c2i", seed=2)
    cond = torch.tensor([1, 2])
    tokens = torch.randint(0, 48, (2, 16))
    ref = Generator(model, device="cpu", dtype="fp32").cached_logits(cond, tokens)
    low = Generator(model, device="cpu", dtype="bf16").cached_logits(cond, tokens)
    assert low.dtype == torch.float32
    assert (low - ref).norm() / ref.norm() < 0.05


def test_compiled_engine_outlives_torch_default_recompile_limit():
    """Each batch is its own compiled program of the same block halves (fullgraph) and sampling: with
    torch's limit of programs per function set low, a new batch past it would fail to compile (or run
    its sampling eagerly); the engine raises the limit, so every batch compiles and samples what the
    eager engine samples."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from arsparse.engine import generator

    name = generator.recompile_limit_name()
    dynamo.reset()
    counters.clear()
    model = random_gpt("c2i", seed=int(torch.randint(0, 1000, ())), image_tokens=4)
    graphs = []
    try:
        with dynamo.config.patch(**{name: 1}):  # (restored on exit, the engine's raise included)
            for n in (1, 2, 3):
                cond = random_cond(model, n)
                got = Generator(model, device="cpu", dtype="fp32", compile=True).sample_tokens(cond, seed=n, top_k=1)
                graphs.append(counters["stats"]["unique_graphs"])
                want = Generator(model, device="cpu", dtype="fp32").sample_tokens(cond, seed=n, top_k=1)
                assert torch.equal(got, want)  # greedy: compiled and eager arithmetic agree on the argmax
            assert getattr(dynamo.config, name) >= generator.RECOMPILE_LIMIT
    finally:  # (its programs would count towards the limit of later tests that compile without the engine)
        dynamo.reset()
    assert graphs[0] < graphs[1] < graphs[2]  # each batch compiled its own programs, none ran eagerly


def test_cached_logits_refuses_tokens_the_model_cannot_take():
    """Teacher forcing through the cache indexed past the vocabulary or the cache (IndexError), broadcast a
    mismatched batch (RuntimeError, or silently) and gave one row of logits for no tokens: each is named now."""
    gpt = random_gpt("c2i", image_tokens=16)  # vocab 48
    gen, cond = Generator(gpt, device="cpu"), random_cond(gpt, 2)
    for tokens, msg in [(torch.full((2, 4), 48), r"token ids must be in \[0, 48\).*got 48"),
                        (torch.full((2, 4), -1), r"token ids must be in \[0, 48\).*got -1"),
                        (torch.zeros(2, 17, dtype=torch.long), "1..16 columns .*got 17"),
                        (torch.zeros(2, 0, dtype=torch.long), "1..16 columns .*got 0"),
                        (torch.zeros(3, 4, dtype=torch.long), "2 conditions for 3 token rows"),
                        (torch.zeros(1, 4, dtype=torch.long), "2 conditions for 1 token rows"),
                        (torch.zeros(2, 4), r"\(B, T\) integer tensor, got torch.float32")]:
        with pytest.raises(ValueError, match=msg):
            gen.cached_logits(cond, tokens)
    tokens = torch.randint(0, 48, (2, 16))
    torch.testing.assert_close(gen.cached_logits(cond, tokens), gpt.logits(cond, tokens), rtol=1e-4, atol=1e-4)


def test_decode_images_of_no_tokens_is_an_empty_batch():
    """As the tokenizers' decode gives: (0, 3, H, W), not torch.cat's error on an empty list."""
    from arsparse.models.vq import VQModel, vq_config
    from arsparse.tokenizers import PaletteTokenizer, VQTokenizer

    gpt = random_gpt("c2i", image_tokens=16)
    vq = VQTokenizer(VQModel(vq_config("VQ-16", ch=32, codebook_size=48)).eval())
    for tok, size in [(PaletteTokenizer(48), 4), (vq, 64)]:
        gen = Generator(gpt, tok, device="cpu")
        assert gen.decode_images(torch.zeros(0, 16, dtype=torch.long)).shape == (0, 3, size, size)
        with pytest.raises(ValueError, match="4x4 = 16 tokens does not match tokens with N=15"):
            gen.decode_images(torch.zeros(0, 15, dtype=torch.long))


@pytest.mark.parametrize("cond", [{1: 2, 3: 4}, {1, 2}, frozenset([1]), torch.tensor([True, False]),
                                  np.array([True, False]), b"12"])
def test_class_labels_in_a_dict_a_set_or_booleans_are_refused(cond):
    """A dict gave its keys as labels, a set its own order, a bool tensor 0s and 1s: refused, saying what is allowed."""
    gen = Generator(random_gpt("c2i"), device="cpu")
    with pytest.raises(ValueError, match="class labels must be an int or a sequence of ints .*integer tensor; "
                                         "not a dict, a set or booleans"):
        gen.as_cond(cond)
    assert gen.as_cond(torch.tensor([1, 2], dtype=torch.int32)).tolist() == [1, 2]  # integer tensors stay
    assert gen.as_cond(np.array([3, 4])).tolist() == [3, 4]


@pytest.mark.parametrize("cond", [torch.ones(1, 5, 12, dtype=torch.bool), torch.ones(1, 5, 12, dtype=torch.long),
                                  np.ones((1, 5, 12), dtype=bool), {"features": 1}, {1.0}])
def test_caption_features_that_are_not_floats_are_refused(cond):
    gen = Generator(random_gpt("t2i"), device="cpu")  # 5 caption tokens of 12 features
    with pytest.raises(ValueError, match=r"caption features must be a \(B, 5, 12\) float tensor or array"):
        gen.as_cond(cond)
    assert gen.as_cond(np.ones((1, 5, 12), dtype=np.float16)).dtype == torch.float32
