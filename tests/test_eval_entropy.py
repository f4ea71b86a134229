"""Entropy-matched sampling temperatures (arsparse.eval.entropy) against direct computations."""
import os

import numpy as np
import pytest
import torch
from PIL import Image

from arsparse import policies
from arsparse.engine.generator import Generator
from arsparse.eval import EvalConfig, HeldOut, evaluate
from arsparse.eval.cli import main as eval_main
from arsparse.eval.entropy import guided_entropy, matched_temperatures, solve_scale
from arsparse.tokenizers import PaletteTokenizer

from conftest import random_cond, random_gpt

DIAG = dict(local=3, rows=2, band=1, sinks=1)  # an 8x8 grid's diagonal read set
NARROW = dict(local=1, rows=1, band=0, sinks=0)  # so narrow that its matched temperature is far from 1


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _direct_entropy(gpt, cond, tokens, policy, g, s) -> float:
    """Mean entropy of softmax(s * (u + g (c - u))), from gpt.logits and textbook formulas."""
    kw = {} if policy is None else dict(policy=policy)
    with torch.no_grad():
        c = gpt.logits(cond, tokens, **kw).double()
        u = gpt.logits(torch.full_like(cond, gpt.config.num_classes), tokens, **kw).double()
    p = torch.softmax(s * (u + g * (c - u)), -1)
    return float(-(p * p.log()).sum(-1).mean())


def test_guided_entropy_is_the_mean_entropy_of_the_guided_distribution():
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 991)
    cond = random_cond(gpt, 5, seed=seed)
    tokens = torch.randint(0, gpt.config.vocab_size, (5, 64), generator=torch.Generator().manual_seed(seed))
    g = 1.0 + (seed % 300) / 100  # guidance in [1, 4)
    scales = torch.tensor([0.6, 1.0, 1.7], dtype=torch.float64)
    for pol in (None, policies.get("diagonal", **DIAG), policies.get("h2o", rho=0.3)):
        got = guided_entropy(gpt, cond, tokens, pol, g, scales, batch=2)
        want = [_direct_entropy(gpt, cond, tokens, pol, g, s) for s in scales.tolist()]
        assert got.tolist() == pytest.approx(want, rel=1e-4)
        assert got[0] > got[1] > got[2] > 0  # sharper with the scale


def test_solve_scale_interpolates_and_says_when_out_of_reach():
    rng = np.random.default_rng(fresh_seed())
    scales = torch.tensor(np.sort(rng.uniform(0.3, 3.0, 12)), dtype=torch.float64)
    a, b = rng.uniform(1, 2), rng.uniform(0.2, 1)
    curve = a - b * scales  # linear: interpolation is exact
    s_true = float(rng.uniform(scales[0], scales[-1]))
    assert solve_scale(scales, curve, a - b * s_true) == pytest.approx(s_true, rel=1e-9)
    assert solve_scale(scales, curve, float(curve[4])) == pytest.approx(float(scales[4]))  # on a grid point
    assert solve_scale(scales, curve, float(curve[0]) + 0.01) is None  # above the curve
    assert solve_scale(scales, curve, float(curve[-1]) - 0.01) is None  # below it


def test_matched_temperature_gives_the_policy_dense_entropy():
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 983)
    cond = random_cond(gpt, 4, seed=seed)
    tokens = torch.randint(0, gpt.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(seed + 1))
    t0 = 0.8 + (seed % 40) / 100  # the run's temperature, in [0.8, 1.2)
    diag = policies.get("diagonal", **DIAG)
    everything = policies.get("streaming", sinks=0, recent=64)  # reads every key: dense's distribution
    got = matched_temperatures(gpt, cond, tokens, {"dense": None, "diagonal": diag, "all": everything}, 2.0, t0,
                               batch=3)
    assert got["dense"]["temperature"] == t0
    target = _direct_entropy(gpt, cond, tokens, None, 2.0, 1 / t0)
    assert got["dense"]["entropy"] == pytest.approx(target, rel=1e-4)
    assert got["all"]["temperature"] == pytest.approx(t0, rel=1e-4)
    # The diagonal at its matched temperature has dense's entropy (up to the grid's interpolation), and it
    # was measured at the run's temperature first.
    assert got["diagonal"]["entropy"] == pytest.approx(_direct_entropy(gpt, cond, tokens, diag, 2.0, 1 / t0), rel=1e-4)
    at_matched = _direct_entropy(gpt, cond, tokens, diag, 2.0, 1 / got["diagonal"]["temperature"])
    assert at_matched == pytest.approx(target, rel=2e-3)
    assert (got["diagonal"]["temperature"] < t0) == (got["diagonal"]["entropy"] > target)
    with pytest.raises(ValueError, match="positive sampling temperature"):
        matched_temperatures(gpt, cond, tokens, {"diagonal": diag}, 2.0, 0.0)


def test_eval_samples_each_policy_at_its_matched_temperature(tmp_path):
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 977)
    tok = PaletteTokenizer(48)
    g = torch.Generator().manual_seed(seed)
    heldout = HeldOut(torch.randint(0, 7, (12,), generator=g), torch.randint(0, 48, (12, 64), generator=g),
                      "random test tokens")
    cfg = EvalConfig(policies=["dense", "diagonal"], policy_args={"diagonal": NARROW}, num_samples=8, nll_images=6,
                     batch_size=8, nll_batch=3, ref_images=12, grid_images=8, cfg_scale=2.0, seed=seed % 10_000,
                     match_entropy=True)
    res = evaluate(gpt, tok, cfg, heldout=heldout, out_dir=tmp_path, progress=False)
    dense, diag = res["rows"]
    assert dense["temperature"] == 1.0 and abs(diag["temperature"] - 1.0) > 0.1
    want = matched_temperatures(gpt, heldout.cond[:6], heldout.tokens[:6],
                                {"diagonal": policies.get("diagonal", **NARROW)}, 2.0, 1.0)
    assert diag["temperature"] == pytest.approx(want["diagonal"]["temperature"], rel=1e-9)
    assert diag["guided_entropy"] == pytest.approx(want["diagonal"]["entropy"], rel=1e-9)
    assert "entropy-matched temperatures" in (tmp_path / "eval.md").read_text()
    # The diagonal's images are the ones its generator samples at that temperature on the same seeds.
    gen = Generator(gpt, tok, device="cpu", policy=policies.get("diagonal", **NARROW))
    toks = gen.sample_tokens(torch.arange(8) % gpt.config.num_classes, cfg_scale=2.0, temperature=diag["temperature"],
                             seed=[cfg.seed + i for i in range(8)])
    other = gen.sample_tokens(torch.arange(8) % gpt.config.num_classes, cfg_scale=2.0, temperature=1.0,
                              seed=[cfg.seed + i for i in range(8)])
    assert not torch.equal(toks, other)
    from arsparse.eval.evaluate import _save_grid

    _save_grid(gen.decode_images(toks), tmp_path / "want.png", nrow=7)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "grid-diagonal.png")),
                          np.asarray(Image.open(tmp_path / "want.png")))


def test_match_entropy_setting_is_checked(capsys):
    with pytest.raises(ValueError, match="needs nll_images >= 1"):
        EvalConfig(match_entropy=True, nll_images=0)
    with pytest.raises(ValueError, match="temperature > 0"):
        EvalConfig(match_entropy=True, temperature=0.0)
    with pytest.raises(ValueError, match="match_entropy is a bool"):
        EvalConfig(match_entropy=1)
    assert eval_main(["--sweep-rho", "0.2", "--match-entropy", "--quiet"]) == 2
    assert "--match-entropy applies to the eval, not to --sweep-rho" in capsys.readouterr().err
