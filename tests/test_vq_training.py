"""The VQ trainer: it learns, restarts dead codes, resumes exactly, and exports a VQ load_vq reads alone."""
import math

import numpy as np
import pytest
import torch

from arsparse.loading import load_vq, read_metadata
from arsparse.training.trainer import portable_checkpoint
from arsparse.training.vq_trainer import (VQ_RECIPES, VQTrainConfig, export_vq, load_vq_checkpoint,
                                          restart_dead_codes, train_vq, usage_stats, vq_batch, vq_recipe_config)


def tiny(out_dir, **kw) -> VQTrainConfig:
    args = dict(ch=32, ch_mult=(1, 2), z_channels=32, num_res_blocks=1, codebook_size=32, codebook_embed_dim=4,
                image_size=16, steps=8, batch_size=8, lr=3e-3, warmup=1, log_every=2, eval_every=1000,
                ckpt_every=1000, restart_every=3, progress=False, export_dtype="fp32")
    args.update(kw)
    return VQTrainConfig(out_dir=str(out_dir), **args)


def shapes(n=48, size=16, seed=0):
    """White images with one random coloured rectangle each: (n, size, size, 3) uint8."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full((n, size, size, 3), 255, dtype=torch.uint8)
    for i in range(n):
        y0, x0 = torch.randint(0, size // 2, (2,), generator=g).tolist()
        h, w = torch.randint(3, size // 2, (2,), generator=g).tolist()
        x[i, y0:y0 + h, x0:x0 + w] = torch.randint(0, 256, (3,), generator=g).to(torch.uint8)
    return x


def test_tiny_vq_learns_to_reconstruct(tmp_path):
    x, xv = shapes(64), shapes(16, seed=1)
    res = train_vq(tiny(tmp_path, steps=40, eval_every=20, lr=4e-3), x, xv, resume=False)
    assert res.finished and res.vq_path.is_file()
    tr, val = res.history["train"], res.history["val"]
    assert tr[-1]["l1"] < 0.6 * tr[0]["l1"]
    assert val[-1]["psnr"] > val[0]["psnr"] and val[-1]["step"] == 40
    assert 0 < val[-1]["usage"] <= 1 and 1 <= val[-1]["perplexity"] <= 32
    assert [r["step"] for r in res.history["restarts"]] == list(range(3, 40, 3))


def test_resume_reaches_the_same_weights(tmp_path):
    x, xv = shapes(), shapes(8, seed=1)
    full = train_vq(tiny(tmp_path / "a"), x, xv, resume=False)
    half = train_vq(tiny(tmp_path / "b"), x, xv, stop_after=4)
    assert not half.finished and half.step == 4 and half.vq_path is None
    rest = train_vq(tiny(tmp_path / "b"), x, xv, resume=True)
    assert rest.finished and rest.step == 8
    a, b = load_vq_checkpoint(full.ckpt_path), load_vq_checkpoint(rest.ckpt_path)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert torch.equal(a["since_restart"], b["since_restart"])
    assert a["history"]["restarts"] == b["history"]["restarts"]
    with pytest.raises(FileExistsError):
        train_vq(tiny(tmp_path / "b"), x, xv, resume=False)
    with pytest.raises(ValueError, match="another config"):
        train_vq(tiny(tmp_path / "b", lr=1e-3), x, xv)
    with pytest.raises(ValueError, match="other images"):
        train_vq(tiny(tmp_path / "b"), shapes(seed=5), xv)


def test_time_limit_stops_with_a_checkpoint(tmp_path):
    x = shapes()
    with pytest.warns(UserWarning, match="no training step fitted"):
        res = train_vq(tiny(tmp_path, time_limit_s=1e-3), x)
    assert not res.finished and res.ckpt_path.is_file() and res.step == 0
    res = train_vq(tiny(tmp_path, time_limit_s=None), x)
    assert res.finished and res.step == 8


def test_portable_checkpoint_resumes_without_optimiser_state(tmp_path):
    x = shapes()
    half = train_vq(tiny(tmp_path / "a"), x, stop_after=4)
    small = portable_checkpoint(half.ckpt_path, tmp_path / "b" / "ckpt.pt", dtype="fp16")
    ck = torch.load(small, weights_only=True)
    assert ck["optimizer"] is None and ck["step"] == 4
    assert all(v.dtype == torch.float16 for v in ck["model"].values() if v.is_floating_point())
    assert small.stat().st_size < 0.6 * half.ckpt_path.stat().st_size
    res = train_vq(tiny(tmp_path / "b"), x, resume=True)
    assert res.finished and res.step == 8
    assert [r["step"] for r in res.history["train"]] == [2, 4, 6, 8]


def test_export_loads_alone_and_codes_match(tmp_path):
    x = shapes(16)
    res = train_vq(tiny(tmp_path, steps=2), x)
    tok = load_vq(res.vq_path)
    assert "arsparse.vq" in read_metadata(res.vq_path)
    ck = load_vq_checkpoint(res.ckpt_path)
    from arsparse.models.vq import VQModel

    ref = VQModel(tok.model.config)
    ref.load_state_dict(ck["model"])
    ref.eval()
    imgs = x.permute(0, 3, 1, 2).float() / 127.5 - 1
    ids = tok.encode(imgs).clone()
    with torch.no_grad():
        assert torch.equal(ids, ref.encode_indices(imgs))
        torch.testing.assert_close(tok.decode(ids, (8, 8)), ref.decode_indices(ids, (8, 8)).clamp(-1, 1))
    half = export_vq(res.ckpt_path, tmp_path / "half.safetensors", dtype="fp16")
    assert half.stat().st_size < 0.6 * res.vq_path.stat().st_size


def test_restart_moves_dead_codes_onto_features_and_clears_their_moments():
    from arsparse.models.vq import VQModel, vq_config

    model = VQModel(vq_config("VQ-16", ch=32, ch_mult=(1, 2), z_channels=32, codebook_size=8, codebook_embed_dim=4))
    opt = torch.optim.AdamW(model.parameters())
    model.quantize.embedding.weight.sum().backward()
    opt.step()
    w0 = model.quantize.embedding.weight.detach().clone()
    counts = torch.tensor([3, 0, 1, 0, 0, 7, 1, 2])
    feats = torch.nn.functional.normalize(torch.randn(20, 4), dim=-1)
    n = restart_dead_codes(model, opt, counts, feats, torch.Generator().manual_seed(0))
    w = model.quantize.embedding.weight.detach()
    dead = counts == 0
    assert n == 3
    assert torch.equal(w[~dead], w0[~dead])
    for row in w[dead]:  # each dead code now sits on one of the features
        assert (feats - row).abs().sum(-1).min() < 1e-6
    state = opt.state[model.quantize.embedding.weight]
    assert (state["exp_avg"][dead] == 0).all() and (state["exp_avg_sq"][dead] == 0).all()
    assert (state["exp_avg_sq"][~dead] != 0).all()


def test_usage_stats_match_a_direct_computation():
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    counts = rng.integers(0, 5, 64)
    counts[0] = 1
    p = counts / counts.sum()
    ent = -(p[p > 0] * np.log(p[p > 0])).sum()
    s = usage_stats(torch.from_numpy(counts))
    assert s["usage"] == pytest.approx((counts > 0).mean())
    assert s["perplexity"] == pytest.approx(math.exp(ent))


def test_batches_are_a_function_of_seed_and_step():
    x = shapes(32)
    cfg = tiny("unused")
    a, b = vq_batch(cfg, 5, x), vq_batch(cfg, 5, x)
    assert torch.equal(a, b) and a.shape == (8, 3, 16, 16)
    assert not torch.equal(a, vq_batch(cfg, 6, x))
    flipped = vq_batch(tiny("unused", hflip=True), 0, x)
    plain = vq_batch(tiny("unused", hflip=False), 0, x)
    same = [(flipped[i] == plain[i]).all() for i in range(8)]
    mirrored = [(flipped[i] == plain[i].flip(-1)).all() for i in range(8)]
    assert all(s or m for s, m in zip(same, mirrored)) and not all(same)


def test_config_validation_and_recipe():
    with pytest.raises(ValueError, match="image_size"):
        tiny("x", image_size=15)
    with pytest.raises(ValueError, match="ch must be a multiple of 32"):
        tiny("x", ch=48)
    with pytest.raises(ValueError, match="restart_every"):
        tiny("x", restart_every=-1)
    with pytest.raises(ValueError, match="l1_weight"):
        tiny("x", l1_weight=0, l2_weight=0)
    cfg = vq_recipe_config("emoji-vq", "out/x")
    vc = cfg.vq_config()
    assert vc.downsample == 2 and cfg.grid == 32 and vc.codebook_l2_norm and cfg.commit_beta == 0.25
    from arsparse.models.vq import VQModel

    n = sum(p.numel() for p in VQModel(vc).parameters())
    assert n * 2 < 8e6  # fp16 VQ under 8 MB, so GPT + VQ stay under ~45 MB
    with pytest.raises(ValueError, match="unknown VQ recipe"):
        vq_recipe_config("nope", "out/x")
    assert set(VQ_RECIPES) == {"emoji-vq"}
    with pytest.raises(ValueError, match="uint8"):
        train_vq(tiny("x"), torch.zeros(8, 16, 16, 3))
