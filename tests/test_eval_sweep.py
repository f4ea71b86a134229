"""arsparse eval --sweep-rho: budgets per policy, the crossing of the tolerance, the report."""
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from arsparse import policies
from arsparse.eval import EvalConfig, HeldOut, build_policies
from arsparse.eval.cli import main as eval_main
from arsparse.policies import policy_at_budget
from arsparse.eval.forcing import forced_logits
from arsparse.eval.sweep import check_rhos, crossing, parse_rhos, sweep
from arsparse.policies.base import dense_entries
from arsparse.tokenizers import PaletteTokenizer

from conftest import random_cond, random_gpt

LN2 = math.log(2.0)
ALL = ["dense", "diagonal", "streaming", "h2o", "tova", "lines", "headkv", "adsa"]
# 8x8 grid: diagonal with small windows (its rho then picks 1..7 rows of 8), lines with one recent row.
TINY_ARGS = {"diagonal": dict(local=3, band=1, sinks=1), "lines": dict(recent_rows=1)}


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


# ---- the crossing ----------------------------------------------------------------------------------
def test_crossing_hand_made_table():
    # Falls through 2 % between 0.2 (+4 %) and 0.3 (+1 %): 0.2 + (0.04 - 0.02) / (0.04 - 0.01) * 0.1.
    pts = [(0.5, 0.005), (0.05, 0.30), (0.2, 0.04), (0.1, 0.10), (0.3, 0.01)]  # any order
    c = crossing(pts, 0.02)
    assert c["status"] == "interpolated" and c["between"] == [0.2, 0.3]
    assert c["rho"] == pytest.approx(0.2 + 0.1 * 2 / 3)
    # Non-monotone: a later excursion above the tolerance moves the crossing past it.
    c = crossing([(0.1, 0.05), (0.2, 0.01), (0.3, 0.03), (0.4, 0.0)], 0.02)
    assert c["between"] == [0.3, 0.4] and c["rho"] == pytest.approx(0.3 + 0.1 / 3)  # +3 % to 0 %
    # Exactly at the tolerance counts as within; better than dense too.
    assert crossing([(0.1, 0.05), (0.2, 0.02)], 0.02)["rho"] == pytest.approx(0.2)
    c = crossing([(0.1, -0.01), (0.3, 0.019)], 0.02)
    assert c["status"] == "at or below the smallest budget" and c["rho"] == 0.1 and c["text"] == "≤ 0.100"
    c = crossing([(0.1, 0.5), (0.3, 0.021)], 0.02)
    assert c["rho"] is None and c["status"] == "not reached within the sweep"
    assert "not reached within the sweep" in c["text"]
    # Missing costs are skipped, equal budgets averaged (diagonal's rows can map two requests to one).
    c = crossing([(0.1, None), (0.2, 0.05), (0.2, 0.03), (0.4, 0.0)], 0.02)
    assert c["rho"] == pytest.approx(0.2 + 0.2 * (0.04 - 0.02) / 0.04)
    assert crossing([(0.1, None)], 0.02) == dict(rho=None, status="no data", between=None, text="—")


@pytest.mark.parametrize("trial", range(20))
def test_crossing_matches_a_fine_grid_of_the_interpolant(trial):
    """Against an independent reference: the smallest x on a fine grid from which the piecewise-linear
    interpolant of the points never exceeds the tolerance again."""
    rng = np.random.default_rng(fresh_seed())
    n = int(rng.integers(2, 9))
    rho = np.sort(rng.choice(np.arange(1, 200), size=n, replace=False) / 200)
    cost = rng.uniform(-0.01, 0.08, size=n) * np.linspace(2, 0.2, n)  # mostly falling, often not monotone
    tol = 0.02
    got = crossing(list(zip(rho.tolist(), cost.tolist())), tol)
    xs = np.linspace(rho[0], rho[-1], 200_001)
    above = np.interp(xs, rho, cost) > tol + 1e-12
    if not above.any():
        assert got["rho"] == pytest.approx(rho[0])
    elif above[-1]:
        assert got["rho"] is None
    else:
        want = xs[np.nonzero(above)[0][-1] + 1]
        assert got["rho"] == pytest.approx(want, abs=2 * (xs[1] - xs[0]))


# ---- budgets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,match", [("0", r"out of range.*\(0, 1\]"), ("0.1,1.5", r"1\.5.*out of range"),
                                       ("-0.2", "out of range"), ("nan", "out of range"), ("0.1,abc", "'abc'"),
                                       ("", "not a number"), ("0.2,0.2", "listed twice"), ("0.1,,0.2", "not a number")])
def test_bad_sweep_budgets_are_rejected_clearly(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_rhos(bad)


def test_sweep_budgets_parse_and_check():
    assert parse_rhos(" 0.5, 0.06,1") == (0.06, 0.5, 1.0)
    assert check_rhos([0.25, 1]) == (0.25, 1.0)
    for bad in ([], [True], ["0.1"], [0.0]):
        with pytest.raises(ValueError):
            check_rhos(bad)


def test_bad_sweep_budget_on_the_command_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        eval_main(["--sweep-rho", "0.1,1.2", "--out", str(tmp_path), "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--sweep-rho" in err and "1.2" in err and "(0, 1]" in err


@pytest.mark.parametrize("name", ["headkv", "h2o", "streaming", "lines", "diagonal"])
def test_policy_at_budget_keeps_the_most_that_fits(name):
    """Against brute force over every rho the policy can be asked for."""
    gpt = random_gpt(image_tokens=64)
    L, H, lay = gpt.config.n_layer, gpt.config.n_head, gpt.layout
    n = dense_entries(lay)
    params = TINY_ARGS.get(name, {})

    def kept(k):
        try:
            return policies.get(name, **params, rho=min(1.0, (k + 0.5) / n)).budget(lay, L, H).kept
        except policies.PolicyError:
            return None

    table = {k: kept(k) for k in range(1, n + 1)}
    for target in sorted(np.random.default_rng(fresh_seed()).choice(np.arange(8, n + 1), 6, replace=False)):
        fits = [v for v in table.values() if v is not None and v <= target]
        if not fits:
            with pytest.raises(policies.PolicyError):
                policy_at_budget(name, params, int(target), lay, L, H)
            continue
        got = policy_at_budget(name, params, int(target), lay, L, H).budget(lay, L, H).kept
        assert got == max(fits), (target, got, max(fits))
    if name == "headkv":  # pads its slot table: asking for the target itself overshoots
        assert table[40] > 40


def test_match_budget_includes_headkv():
    gpt = random_gpt(image_tokens=64)
    lay, L, H = gpt.layout, gpt.config.n_layer, gpt.config.n_head
    args = {"diagonal": dict(local=3, rows=2, band=1, sinks=1), "lines": dict(recent_rows=1)}
    built, match = build_policies(ALL, args, True, lay, L, H)
    kept = {n: p.budget(lay, L, H).kept for n, p in built.items()}
    assert all(kept[n] == match["kept"] for n in ("streaming", "h2o", "tova", "lines", "adsa"))
    assert match["kept"] - 2 <= kept["headkv"] <= match["kept"]  # the most its padded table allows


# ---- teacher forcing ---------------------------------------------------------------------------------
def test_offset_masks_equal_read_positions():
    """The teacher-forcing masks of offset policies (uniform and per head) against read_positions, row by row."""
    from dataclasses import dataclass

    from arsparse.layout import Layout
    from arsparse.policies.offset import OffsetPolicy

    rng = np.random.default_rng(fresh_seed())
    L, H = 2, 3
    per_head = [[sorted({0, *rng.choice(np.arange(1, 40), size=int(rng.integers(1, 6)), replace=False).tolist()})
                 for _ in range(H)] for _ in range(L)]

    @dataclass(frozen=True)
    class PerHead(OffsetPolicy):
        def sink_count(self, layout):
            return 2

        def head_offsets(self, layout, n_layer, n_head):
            return per_head

    lay = Layout(prefix_len=int(rng.integers(1, 4)), grid_h=5, grid_w=6, row_stride=6)
    T = lay.prefix_len + lay.image_tokens - 1
    for pol in (PerHead(), policies.get("diagonal", local=3, rows=2, band=1, sinks=1),
                policies.get("streaming", sinks=2, recent=int(rng.integers(1, 20)))):
        mask = pol.mask(lay, T, L, H)  # (L, H, T, T)
        for li in range(L):
            for h in range(H):
                for q in range(T):
                    want = pol.read_positions(lay, q, li, h, L, H)
                    assert mask[li, h, q].nonzero()[:, 0].tolist() == want, (type(pol).__name__, li, h, q)


@pytest.mark.parametrize("name,params", [("h2o", dict(rho=0.4)), ("headkv", dict(rho=0.5, recent=4))])
def test_forced_logits_loop_equals_the_policy_path(name, params):
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 991)
    cond = random_cond(gpt, 3, seed=seed)
    tokens = torch.randint(0, 48, (3, 64), generator=torch.Generator().manual_seed(seed))
    pol = policies.get(name, **params)
    got = forced_logits(gpt, cond, tokens, pol, graphs=False)
    with torch.no_grad():
        want = gpt.logits(cond, tokens, policy=pol)
        dense = gpt.logits(cond, tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - dense).abs().max() > 1e-2  # it evicted something
    torch.testing.assert_close(forced_logits(gpt, cond, tokens, None), dense)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,params", [("h2o", dict(rho=0.4)), ("headkv", dict(rho=0.5, recent=4)),
                                         ("lines", dict(rho=0.5, recent_rows=1))])
def test_forced_logits_cuda_graph_equals_eager(name, params):
    gpt = random_gpt(image_tokens=64, seed=3).cuda()
    cond = random_cond(gpt, 5, seed=4).cuda()
    tokens = torch.randint(0, 48, (5, 64), generator=torch.Generator().manual_seed(5)).cuda()
    pol = policies.get(name, **params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture warns and falls back to eager: an error here
        graphed = forced_logits(gpt, cond, tokens, pol, graphs=True)
    eager = forced_logits(gpt, cond, tokens, pol, graphs=False)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


# ---- the whole sweep ---------------------------------------------------------------------------------
def test_sweep_end_to_end_tiny(tmp_path):
    seed = fresh_seed()
    gpt = random_gpt(image_tokens=64, seed=seed % 997)
    g = torch.Generator().manual_seed(seed)
    held = HeldOut(torch.randint(0, 7, (10,), generator=g), torch.randint(0, 48, (10, 64), generator=g), "random")
    rhos = [0.15, 0.3, 0.6, 1.0]
    cfg = EvalConfig(policies=ALL, policy_args=TINY_ARGS, nll_images=5, nll_batch=3, num_samples=4, batch_size=4,
                     ref_images=10, grid_images=0)
    res = sweep(gpt, PaletteTokenizer(48), cfg, rhos, heldout=held, out_dir=tmp_path, model_name="tiny",
                progress=False)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    rows = saved["rows"]
    assert [(r["policy"], r["rho_requested"]) for r in rows] == [("dense", 1.0)] + [
        (n, r) for n in ALL[1:] for r in rhos]
    dense = rows[0]
    assert dense["rel_to_dense"] == 0.0 and dense["kl_to_dense"] == pytest.approx(0.0, abs=1e-7)
    with torch.no_grad():
        logits = gpt.logits(held.cond[:5], held.tokens[:5])
    want = F.cross_entropy(logits.reshape(-1, 48), held.tokens[:5].reshape(-1)).item() / LN2
    assert dense["nll_bits_per_token"] == pytest.approx(want, rel=1e-5)
    n = dense_entries(gpt.layout)
    for r in rows[1:]:
        if r["error"]:  # only budgets too small for the policy's protected set
            assert r["rho_requested"] == 0.15 and r["policy"] in ("diagonal", "lines", "headkv", "adsa"), r
            assert r["nll_bits_per_token"] is None and r["rel_to_dense"] is None and r["kept"] is None
            continue
        assert r["rho"] == pytest.approx(r["kept"] / n, abs=1e-4) and r["kept"] <= math.floor(r["rho_requested"] * n)
        assert r["rel_to_dense"] == pytest.approx(r["nll_bits_per_token"] / dense["nll_bits_per_token"] - 1)
    for r in rows:  # diagonal's rho picks whole rows: prompt + sink + rows of 8 + band + itself
        if r["policy"] == "diagonal" and not r["error"]:
            assert r["kept"] == 1 + 1 + 8 * r["derived"]["rows"] + 1 + 1
    # Spot check one row against a direct computation with that policy.
    h2o = next(r for r in rows if r["policy"] == "h2o" and r["rho_requested"] == 0.3)
    with torch.no_grad():
        sl = gpt.logits(held.cond[:5], held.tokens[:5], policy=policies.get("h2o", **h2o["params"]))
    want = F.cross_entropy(sl.reshape(-1, 48), held.tokens[:5].reshape(-1)).item() / LN2
    assert h2o["nll_bits_per_token"] == pytest.approx(want, rel=1e-5) and h2o["kept"] == 19
    # A scored policy at rho 1 keeps everything: exactly dense.
    for name in ("h2o", "tova", "adsa"):
        full = next(r for r in rows if r["policy"] == name and r["rho_requested"] == 1.0)
        assert full["rho"] == 1.0 and full["rel_to_dense"] == pytest.approx(0.0, abs=1e-6)
    # The crossings are the crossing function of each policy's rows.
    assert saved["metrics"] == ["nll_bits_per_token"] and set(saved["crossings"]) == set(ALL[1:])
    for name, per in saved["crossings"].items():
        mine = [(r["rho"], r["rel_to_dense"]) for r in rows if r["policy"] == name and not r["error"]]
        assert per["nll_bits_per_token"] == crossing(mine, 0.02)
    md = (tmp_path / "sweep.md").read_text()
    assert all(f"`{name}`" in md for name in ALL[1:]) and "within 2%" in md
    assert Image.open(tmp_path / "sweep.png").size[0] > 300


def test_sweep_from_the_command_line_with_frechet(tmp_path, monkeypatch, capsys):
    import arsparse.bundles as bundles
    import arsparse.eval.mobilenet as mobilenet

    gpt = random_gpt(image_tokens=64, seed=fresh_seed() % 997, num_classes=10)  # (the fashion classifier's classes)
    monkeypatch.setattr(bundles, "load_model", lambda name: (gpt, PaletteTokenizer(48)))
    monkeypatch.setattr(mobilenet, "find_mobilenet_weights", lambda path=None: None)
    out = tmp_path / "sw"
    base = ["--model", "random-small", "--policies", "dense,streaming,h2o", "--nll-images", "4", "--num-samples",
            "8", "--batch-size", "8", "--classifier", str(_fashion_classifier()), "--out", str(out), "--quiet"]
    assert eval_main(base + ["--sweep-rho", "0.3,0.7", "--sweep-frechet", "--sweep-tolerance", "5", "--kid", "4",
                             "--kid-subset-size", "5", "--fd-infinity"]) == 0
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["tolerance"] == 0.05 and saved["config"]["frechet"] and saved["config"]["rhos"] == [0.3, 0.7]
    dense_kid = saved["rows"][0]["kid_classifier"]  # (an unbiased estimate: may fall to or below 0)
    metrics = ["nll_bits_per_token", "fd_classifier", "fd_classifier_inf", "kid_classifier"]  # (no MobileNetV2 here)
    assert saved["metrics"] == metrics
    assert len(saved["rows"]) == 1 + 2 * 2
    for r in saved["rows"]:
        assert r["fd_classifier"] > 0 and 0 <= r["class_accuracy"] <= 1 and np.isfinite(r["kid_classifier"])
        want = (r["kid_classifier"] - dense_kid) / dense_kid if dense_kid > 0 else None
        assert r["kid_classifier_rel_to_dense"] == (pytest.approx(want) if want is not None else None)
        assert np.isfinite(r["fd_classifier_inf"]) and "fd_dims" not in r
    assert saved["rows"][0]["fd_classifier_rel_to_dense"] == 0.0
    assert set(saved["crossings"]["h2o"]) == set(metrics)
    # the extrapolation is the eval's, on the same images: a plain eval's dense row agrees
    assert eval_main(base + ["--policies", "dense", "--fd-infinity", "--out", str(tmp_path / "ev")]) == 0
    ev = json.loads((tmp_path / "ev" / "eval.json").read_text())["rows"][0]
    assert ev["policy"] == "dense" and ev["fd_classifier_inf"] == pytest.approx(saved["rows"][0]["fd_classifier_inf"])
    assert "extrapolated" in (out / "sweep.md").read_text()
    # the notes: subsets of 4 to 8 samples (fewer than twice the features), and dense's extrapolation at or below 0
    assert any(n.startswith("fd_classifier_inf extrapolates from subsets of 4 to 8 samples") for n in saved["notes"])
    below = "fd_classifier_inf of dense is not above 0: no relative gaps for it (too few samples to extrapolate from)"
    assert (below in saved["notes"]) == (saved["rows"][0]["fd_classifier_inf"] <= 0)
    if dense_kid <= 0:  # (no relative costs to a base at or below 0)
        assert saved["crossings"]["h2o"]["kid_classifier"]["status"] == "no data"
    assert "within 5%" in capsys.readouterr().out
    # The sweep alone (no value) takes the default budgets; flags that do not fit are refused.
    assert eval_main(base + ["--sweep-rho", "--match-budget"]) == 2
    assert eval_main(base + ["--sweep-frechet"]) == 2
    assert eval_main(base + ["--sweep-rho", "0.5", "--fd-infinity"]) == 2  # (no generation to extrapolate)
    assert eval_main(base + ["--sweep-rho", "0.5", "--sweep-frechet", "--fd-bootstrap", "5"]) == 2
    assert eval_main(base + ["--sweep-rho", "0.5", "--policy-arg", "h2o:rho=0.2"]) == 2
    assert "conflicts with the sweep" in capsys.readouterr().err


def _fashion_classifier():
    from arsparse.eval.classifier import CLASSIFIER_FILES

    return CLASSIFIER_FILES["fashion"]
