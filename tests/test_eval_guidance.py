"""Guidance-matched scales (arsparse.eval.guidance) against direct computations."""
import os

import numpy as np
import pytest
import torch
from PIL import Image

from arsparse import policies
from arsparse.engine.generator import Generator
from arsparse.eval import EvalConfig, HeldOut, evaluate
from arsparse.eval.cli import main as eval_main
from arsparse.eval.entropy import matched_temperatures
from arsparse.eval.guidance import guidance_push, matched_guidance
from arsparse.tokenizers import PaletteTokenizer

from conftest import random_cond, random_gpt

DIAG = dict(local=3, rows=2, band=1, sinks=1)  # an 8x8 grid's diagonal read set
NARROW = dict(local=1, rows=1, band=0, sinks=0)  # so narrow that its matched scale is far from dense's


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _direct_push(gpt, cond, tokens, policy, g) -> float:
    """Mean KL(softmax(u + g (c - u)) || softmax(u)) over positions, from gpt.logits and the textbook formula."""
    kw = {} if policy is None else dict(policy=policy)
    with torch.no_grad():
        c = gpt.logits(cond, tokens, **kw).double()
        u = gpt.logits(torch.full_like(cond, gpt.config.num_classes), tokens, **kw).double()
    p, q = torch.softmax(u + g * (c - u), -1), torch.softmax(u, -1)
    return float((p * (p.log() - q.log())).sum(-1).mean())


def test_guidance_push_is_the_mean_kl_of_guided_to_unconditional():
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 991)
    cond = random_cond(gpt, 5, seed=seed)
    tokens = torch.randint(0, gpt.config.vocab_size, (5, 64), generator=torch.Generator().manual_seed(seed))
    scales = torch.tensor([0.0, 1.0, 1.0 + (seed % 300) / 100], dtype=torch.float64)  # the last in [1, 4)
    for pol in (None, policies.get("diagonal", **DIAG), policies.get("h2o", rho=0.3)):
        got = guidance_push(gpt, cond, tokens, pol, scales, batch=2)
        want = [_direct_push(gpt, cond, tokens, pol, g) for g in scales.tolist()]
        assert got.tolist() == pytest.approx(want, rel=1e-4, abs=1e-6)
        assert got[0] == pytest.approx(0.0, abs=1e-6) and 0 < got[1] < got[2]  # KL(cond || uncond) at 1


def test_matched_guidance_gives_the_policy_dense_push():
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 983)
    cond = random_cond(gpt, 4, seed=seed)
    tokens = torch.randint(0, gpt.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(seed + 1))
    g0 = 1.5 + (seed % 150) / 100  # the run's guidance, in [1.5, 3)
    narrow = policies.get("diagonal", **NARROW)
    everything = policies.get("streaming", sinks=0, recent=64)  # reads every key: dense's distributions
    got = matched_guidance(gpt, cond, tokens, {"dense": None, "narrow": narrow, "all": everything}, g0, batch=3)
    target = _direct_push(gpt, cond, tokens, None, g0)
    assert got["dense"]["cfg_scale"] == g0 and got["dense"]["push"] == pytest.approx(target, rel=1e-4)
    assert got["all"]["cfg_scale"] == pytest.approx(g0, rel=1e-4)
    assert got["narrow"]["push"] == pytest.approx(_direct_push(gpt, cond, tokens, narrow, g0), rel=1e-4)
    g = got["narrow"]["cfg_scale"]  # at its matched scale the policy pushes as far as dense (up to the grid)
    assert _direct_push(gpt, cond, tokens, narrow, g) == pytest.approx(target, rel=5e-3)
    assert (g < g0) == (got["narrow"]["push"] > target)
    with pytest.raises(ValueError, match="a guidance scale > 1, got 1.0"):
        matched_guidance(gpt, cond, tokens, {"narrow": narrow}, 1.0)


def test_eval_samples_each_policy_at_its_matched_guidance(tmp_path):
    """match_guidance (and match_entropy at the matched scales): each row records the scale and temperature
    the matching functions give, and its grid is what the generator samples with them on the same seeds."""
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 977)
    tok = PaletteTokenizer(48)
    g = torch.Generator().manual_seed(seed)
    heldout = HeldOut(torch.randint(0, 7, (12,), generator=g), torch.randint(0, 48, (12, 64), generator=g),
                      "random test tokens")
    cfg = EvalConfig(policies=["dense", "diagonal"], policy_args={"diagonal": NARROW}, num_samples=8, nll_images=6,
                     batch_size=8, nll_batch=3, ref_images=12, grid_images=8, cfg_scale=2.0, seed=seed % 10_000,
                     match_guidance=True, match_entropy=True)
    res = evaluate(gpt, tok, cfg, heldout=heldout, out_dir=tmp_path, progress=False)
    dense, diag = res["rows"]
    narrow = {"diagonal": policies.get("diagonal", **NARROW)}
    want = matched_guidance(gpt, heldout.cond[:6], heldout.tokens[:6], narrow, 2.0)
    assert dense["cfg_scale"] == 2.0 and diag["cfg_scale"] == pytest.approx(want["diagonal"]["cfg_scale"], rel=1e-9)
    assert abs(diag["cfg_scale"] - 2.0) > 0.05
    assert diag["guidance_push"] == pytest.approx(want["diagonal"]["push"], rel=1e-9)
    temps = matched_temperatures(gpt, heldout.cond[:6], heldout.tokens[:6], narrow,
                                 {"dense": 2.0, "diagonal": diag["cfg_scale"]}, 1.0)
    assert diag["temperature"] == pytest.approx(temps["diagonal"]["temperature"], rel=1e-9)
    assert "guidance-matched scales" in (tmp_path / "eval.md").read_text()
    gen = Generator(gpt, tok, device="cpu", policy=narrow["diagonal"])
    toks = gen.sample_tokens(torch.arange(8) % gpt.config.num_classes, cfg_scale=diag["cfg_scale"],
                             temperature=diag["temperature"], seed=[cfg.seed + i for i in range(8)])
    from arsparse.eval.evaluate import _save_grid

    _save_grid(gen.decode_images(toks), tmp_path / "want.png", nrow=7)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "grid-diagonal.png")),
                          np.asarray(Image.open(tmp_path / "want.png")))


def test_match_guidance_setting_is_checked(capsys):
    with pytest.raises(ValueError, match="needs nll_images >= 1"):
        EvalConfig(match_guidance=True, nll_images=0)
    with pytest.raises(ValueError, match=r"a guidance scale > 1 \(got 1.0\)"):
        EvalConfig(match_guidance=True, cfg_scale=1.0)
    with pytest.raises(ValueError, match="match_guidance is a bool"):
        EvalConfig(match_guidance=1)
    assert eval_main(["--sweep-rho", "0.2", "--match-guidance", "--quiet"]) == 2
    assert "--match-guidance applies to the eval, not to --sweep-rho" in capsys.readouterr().err
