"""The GPT trainer: it learns, resumes exactly, and exports a model load_gpt reads alone."""
import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F

import arsparse
from arsparse.data import FashionDataError, find_fashion_dir, load_fashion
from arsparse.loading import read_metadata
from arsparse.models.gpt import GPT
from arsparse.tokenizers import PaletteTokenizer
from arsparse.training import RECIPES, TrainConfig, export_model, load_checkpoint, recipe_config, train_gpt
from arsparse.training.trainer import batch_indices, lr_at, make_batch

try:
    find_fashion_dir()
    HAVE_FASHION = True
except FashionDataError:
    HAVE_FASHION = False
needs_fashion = pytest.mark.skipif(
    not HAVE_FASHION,
    reason="Fashion-MNIST is not installed: `apt-get install dataset-fashion-mnist` (CI installs it)")


def tiny_cfg(out_dir, **kw) -> TrainConfig:
    args = dict(preset="GPT-tiny", vocab_size=16, num_classes=10, grid_h=4, grid_w=4, steps=10, batch_size=8,
                lr=3e-3, warmup=2, eval_every=1000, ckpt_every=1000, log_every=5, progress=False,
                export_dtype="fp32")
    args.update(kw)
    return TrainConfig(out_dir=str(out_dir), **args)


def synthetic(n=64, vocab=16, hw=16, seed=0):
    """Labelled token rows with structure: each class has its own ramp of tokens, plus noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    base = (torch.arange(hw)[None] * (labels[:, None] + 1)) % vocab
    noise = torch.randint(0, 2, (n, hw), generator=g)
    return (base + noise) % vocab, labels


@pytest.fixture(scope="module")
def fashion_7x7():
    """A real slice of Fashion-MNIST, average-pooled to 7x7 and quantised to 16 grey levels."""
    if not HAVE_FASHION:
        pytest.skip("Fashion-MNIST is not installed: `apt-get install dataset-fashion-mnist`")
    tok = PaletteTokenizer(16)
    (x, y), (xv, yv) = load_fashion("train"), load_fashion("test")

    def small(im):
        return tok.bytes_to_tokens(F.avg_pool2d(im[:, None].float(), 4).round()).flatten(1)  # (N, 49)

    return small(x[:2048]), y[:2048], small(xv[:256]), yv[:256]


# ---- learning -----------------------------------------------------------------------------------

@needs_fashion
def test_tiny_model_learns_fashion(tmp_path, fashion_7x7):
    tr, ytr, va, yva = fashion_7x7
    cfg = tiny_cfg(tmp_path, grid_h=7, grid_w=7, steps=30, batch_size=32, lr=1e-2, warmup=3, eval_every=10)
    res = train_gpt(cfg, tr, ytr, va, yva)
    assert res.finished and res.step == 30
    train = [h["train_bpt"] for h in res.history["train"]]
    val = [h["val_bpt"] for h in res.history["val"]]
    assert len(train) == 6 and len(val) == 3
    # The zero-initialised output layer starts at the uniform distribution: log2(16) = 4 bits.
    assert train[0] < 4.0 + 1e-6
    assert train[-1] < train[0] - 0.5, train
    # Better than the token frequencies alone (the unigram model): it uses the context.
    p = torch.bincount(tr.flatten(), minlength=16).float() + 1
    unigram = -torch.log2(p / p.sum())[va.flatten()].mean().item()
    assert val[-1] < unigram - 0.3, (val, unigram)
    assert val[-1] == pytest.approx(res.final_val_bpt)
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert log["finished"] and log["step"] == 30 and log["num_params"] > 0
    assert log["final_val_bpt"] == pytest.approx(val[-1])


# ---- resuming -----------------------------------------------------------------------------------

def test_resume_reaches_the_same_weights(tmp_path):
    tokens, labels = synthetic()
    straight = train_gpt(tiny_cfg(tmp_path / "a", hflip=True), tokens, labels)
    assert straight.finished and straight.step == 10

    first = train_gpt(tiny_cfg(tmp_path / "b", hflip=True), tokens, labels, stop_after=5)
    assert not first.finished and first.step == 5 and first.model_path is None
    assert not (tmp_path / "b" / "model.safetensors").exists()
    assert load_checkpoint(tmp_path / "b" / "ckpt.pt")["step"] == 5
    second = train_gpt(tiny_cfg(tmp_path / "b", hflip=True), tokens, labels)
    assert second.finished and second.step == 10

    a, b = load_checkpoint(straight.ckpt_path), load_checkpoint(second.ckpt_path)
    assert a["step"] == b["step"] == 10
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=1e-7, msg=k)
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=1e-7)
    # and the weights did move
    init = GPT(tiny_cfg(tmp_path / "c").gpt_config()).state_dict()
    assert not torch.allclose(a["model"]["layers.0.attention.wqkv.weight"], init["layers.0.attention.wqkv.weight"])


def test_time_limit_stops_with_a_checkpoint_and_resumes(tmp_path):
    tokens, labels = synthetic()
    with pytest.warns(UserWarning, match="time limit"):
        res = train_gpt(tiny_cfg(tmp_path, time_limit_s=1e-3), tokens, labels, tokens[:8], labels[:8])
    assert not res.finished and res.ckpt_path.is_file()
    assert not json.loads((tmp_path / "train_log.json").read_text())["finished"]
    res = train_gpt(tiny_cfg(tmp_path), tokens, labels, tokens[:8], labels[:8])  # no limit: resumes, finishes
    assert res.finished and res.step == 10 and res.model_path.is_file()
    again = train_gpt(tiny_cfg(tmp_path), tokens, labels, tokens[:8], labels[:8])  # nothing left to do
    assert again.finished and again.step == 10 and again.final_val_bpt == res.final_val_bpt
    assert [v["step"] for v in again.history["val"]] == [10]


def test_resume_refuses_other_settings_or_data(tmp_path):
    tokens, labels = synthetic()
    train_gpt(tiny_cfg(tmp_path), tokens, labels, stop_after=3)
    with pytest.raises(FileExistsError, match="resume"):
        train_gpt(tiny_cfg(tmp_path), tokens, labels, resume=False)
    with pytest.raises(ValueError, match="lr"):
        train_gpt(tiny_cfg(tmp_path, lr=1e-3), tokens, labels)
    with pytest.raises(ValueError, match="other data"):
        train_gpt(tiny_cfg(tmp_path), synthetic(seed=1)[0], labels)
    # run-control settings may change between commands
    res = train_gpt(tiny_cfg(tmp_path, ckpt_every=2, time_limit_s=600.0), tokens, labels)
    assert res.finished


# ---- exporting ----------------------------------------------------------------------------------

def test_exported_model_loads_alone_with_identical_logits(tmp_path):
    tokens, labels = synthetic()
    res = train_gpt(tiny_cfg(tmp_path, tokenizer={"type": "palette", "levels": 16}, dataset="synthetic"),
                    tokens, labels)
    ckpt = load_checkpoint(res.ckpt_path)
    trained = GPT(tiny_cfg(tmp_path).gpt_config())
    trained.load_state_dict(ckpt["model"])
    trained.eval()
    cond, x = labels[:6], tokens[:6]
    want = trained.logits(cond, x)

    loaded = arsparse.load_gpt(res.model_path)  # fp32 export, no other argument
    assert loaded.config == trained.config
    assert torch.equal(loaded.logits(cond, x), want)

    meta = read_metadata(res.model_path)
    assert json.loads(meta["arsparse.tokenizer"]) == {"type": "palette", "levels": 16}
    assert json.loads(meta["arsparse.train"])["step"] == 10

    bf16 = export_model(res.ckpt_path, tmp_path / "half.safetensors", dtype="bf16")
    assert bf16.stat().st_size < res.model_path.stat().st_size * 0.6
    rounded = GPT(trained.config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ckpt["model"].items()})
    assert torch.equal(arsparse.load_gpt(bf16).eval().logits(cond, x), rounded.eval().logits(cond, x))


# ---- pieces -------------------------------------------------------------------------------------

def test_lr_schedule(tmp_path):
    cfg = tiny_cfg(tmp_path, steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(cfg, 100) == pytest.approx(1e-4)
    assert lr_at(cfg, 55) == pytest.approx(1e-4 + 0.5 * 9e-4)


def test_recipe_warmup_is_cut_to_a_quarter_of_a_short_run():
    """--steps below a recipe's warm-up (fashion-c2i: 300): the warm-up becomes a quarter of the steps, so the
    run reaches the peak learning rate and decays; the recipes' own runs and a warmup given explicitly are kept."""
    from arsparse.training.vq_trainer import vq_recipe_config

    cfg = recipe_config("fashion-c2i", "x", steps=10)
    assert cfg.warmup == 2
    lrs = [lr_at(cfg, s) for s in range(cfg.steps)]
    assert lrs[1] == pytest.approx(cfg.lr) == max(lrs)  # the peak, at the end of the warm-up
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] < 0.2 * cfg.lr  # then the cosine decay
    assert lr_at(cfg, cfg.steps) == pytest.approx(cfg.lr * cfg.min_lr_ratio)
    assert [recipe_config("fashion-c2i", "x", steps=s).warmup for s in (None, 1, 3, 100, 1000, 1200, 2000)] == [
        300, 0, 0, 25, 250, 300, 300]
    assert recipe_config("emoji-c2i", "x").warmup == 300 and recipe_config("emoji-c2i", "x", steps=40).warmup == 10
    assert recipe_config("fashion-c2i", "x", steps=10, warmup=7).warmup == 7  # (given: kept as given)
    with pytest.raises(ValueError, match=r"warmup must be an int in \[0, steps=10\], got 20"):
        recipe_config("fashion-c2i", "x", steps=10, warmup=20)
    assert vq_recipe_config("emoji-vq", "x").warmup == 200 and vq_recipe_config("emoji-vq", "x", steps=12).warmup == 3
    one = recipe_config("fashion-c2i", "x", steps=1)  # (no warm-up: the peak at the only step)
    assert lr_at(one, 0) == pytest.approx(one.lr)


def test_batches_cover_each_epoch_and_drop_labels(tmp_path):
    n, bs = 40, 8
    seen = torch.cat([batch_indices(3, s, n, bs) for s in range(5)])
    assert sorted(seen.tolist()) == list(range(n))  # one epoch = a permutation
    assert not torch.equal(batch_indices(3, 5, n, bs), batch_indices(3, 0, n, bs))  # next epoch reshuffles

    tokens = torch.arange(4 * 16).view(4, 16) % 16
    tokens = tokens.repeat(250, 1)  # (1000, 16)
    labels = torch.arange(1000) % 10
    cfg = tiny_cfg(tmp_path, batch_size=100, class_dropout_prob=0.25, hflip=True)
    dropped, flipped = 0, 0
    for step in range(20):
        x, y = make_batch(cfg, step, tokens, labels)
        x2, y2 = make_batch(cfg, step, tokens, labels)
        assert torch.equal(x, x2) and torch.equal(y, y2)  # a pure function of (seed, step)
        idx = batch_indices(cfg.seed, step, 1000, 100)
        null = y == cfg.num_classes
        assert torch.equal(y[~null], labels[idx][~null])
        dropped += int(null.sum())
        grid, src = x.view(-1, 4, 4), tokens[idx].view(-1, 4, 4)
        same = (grid == src).flatten(1).all(1)
        mirrored = (grid == src.flip(-1)).flatten(1).all(1)
        assert bool((same | mirrored).all())
        flipped += int((mirrored & ~same).sum())
    assert 0.2 < dropped / 2000 < 0.3
    assert 0.4 < flipped / 2000 < 0.6


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        tiny_cfg(tmp_path, preset="GPT-huge")
    with pytest.raises(ValueError, match="warmup"):
        tiny_cfg(tmp_path, steps=10, warmup=20)
    with pytest.raises(ValueError, match="class_dropout_prob"):
        tiny_cfg(tmp_path, class_dropout_prob=1.0)
    with pytest.raises(ValueError, match="dim"):
        tiny_cfg(tmp_path, dim=65)
    with pytest.raises(ValueError, match="lr"):
        tiny_cfg(tmp_path, lr=-1.0)
    cfg = tiny_cfg(tmp_path)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="columns"):
        train_gpt(cfg, torch.zeros(16, 9, dtype=torch.long), torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        train_gpt(cfg, torch.zeros(16, 16, dtype=torch.long), torch.full((16,), 10))
    with pytest.raises(ValueError, match="token ids"):
        train_gpt(cfg, torch.full((16, 16), 16), torch.zeros(16, dtype=torch.long))


def test_fashion_recipe_size():
    cfg = recipe_config("fashion-c2i", "unused")
    g = cfg.gpt_config()
    assert (g.grid_h, g.grid_w, g.num_classes, g.vocab_size) == (28, 28, 10, 32)
    assert g.has_null_class  # guidance works
    mb = g.num_params() * 2 / 1e6
    assert 10 < mb <= 40, mb  # small enough to ship as bf16
    assert recipe_config("fashion-c2i", "x", preset="GPT-tiny").gpt_config().dim == 64
    assert recipe_config("fashion-c2i", "x", dim=256, n_head=4).gpt_config().dim == 256
    assert set(RECIPES) >= {"fashion-c2i"}


def test_bf16_autocast_path_runs_on_cpu(tmp_path):
    tokens, labels = synthetic()
    res = train_gpt(tiny_cfg(tmp_path, steps=3, bf16=True), tokens, labels, tokens[:8], labels[:8])
    assert res.finished and math.isfinite(res.final_val_bpt)


# ---- command line -------------------------------------------------------------------------------

def test_cli_parser_and_tokenizer_command(tmp_path, capsys):
    from arsparse.training.cli import add_train_parser, main

    top = argparse.ArgumentParser()
    add_train_parser(top.add_subparsers(dest="command"))
    args = top.parse_args(["train", "model", "--dataset", "fashion", "--steps", "5", "--layers", "3"])
    assert args.steps == 5 and args.layers == 3 and callable(args.func)
    assert main(["tokenizer", "--dataset", "fashion", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == {"type": "palette", "levels": 32}
    with pytest.raises(SystemExit):
        main(["model", "--dataset", "mnist"])
    assert main(["model", "--dataset", "emoji", "--vq", str(tmp_path / "none.safetensors")]) == 2  # no VQ yet
    assert "train tokenizer --dataset emoji" in capsys.readouterr().err
    assert main(["model", "--dataset", "fashion", "--vq", "x.safetensors"]) == 2


@needs_fashion
def test_cli_trains_and_resumes_on_fashion(tmp_path, capsys):
    from arsparse.training.cli import main

    argv = ["model", "--dataset", "fashion", "--preset", "GPT-tiny", "--levels", "8", "--steps", "4",
            "--warmup", "1", "--batch-size", "4", "--eval-samples", "8", "--device", "cpu", "--quiet",
            "--out", str(tmp_path), "--resume"]
    assert main(argv + ["--stop-after", "2"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["step"] == 2 and not first["finished"]
    assert main(argv) == 0
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done["finished"] and done["step"] == 4
    gpt = arsparse.load_gpt(done["model"])
    assert (gpt.config.grid_h, gpt.config.vocab_size, gpt.config.num_classes) == (28, 8, 10)
    assert main(argv[:-1]) == 2  # without --resume an existing checkpoint is refused


def test_portable_checkpoint_resumes_elsewhere(tmp_path):
    """fp16 weights, no optimiser: the step, schedule and batches continue; the weights start from the rounded ones."""
    from arsparse.training import trainer as T

    tokens, labels = synthetic()
    half = train_gpt(tiny_cfg(tmp_path / "a"), tokens, labels, stop_after=5)
    small = T.portable_checkpoint(half.ckpt_path, tmp_path / "b" / "ckpt.pt")
    ck = load_checkpoint(small)
    assert ck["optimizer"] is None and ck["step"] == 5
    full = load_checkpoint(half.ckpt_path)
    for k, v in full["model"].items():
        assert torch.equal(ck["model"][k], v.half()) if v.is_floating_point() else torch.equal(ck["model"][k], v)
    res = train_gpt(tiny_cfg(tmp_path / "b"), tokens, labels, resume=True)
    assert res.finished and res.step == 10 and res.history["train"][-1]["step"] == 10
    with pytest.raises(ValueError, match="dtype"):
        T.portable_checkpoint(half.ckpt_path, tmp_path / "c.pt", dtype="int8")


def test_cli_refuses_bad_flags_before_the_data(tmp_path, capsys, monkeypatch):
    """Flags the run would ignore or get wrong, a CUDA device where there is none and an output folder that
    cannot be written: one-line errors before the data is loaded or tokenised."""
    from pathlib import Path

    from arsparse.cli import main
    from arsparse.training import datasets

    def no_data(*a, **k):
        raise AssertionError("the data was loaded before the flags were checked")

    monkeypatch.setattr(datasets, "load_token_dataset", no_data)
    afile = tmp_path / "afile"
    afile.write_text("")
    vq = str(Path(arsparse.__file__).parent / "weights" / "emoji-vq.safetensors")
    base = ["train", "model", "--steps", "2", "--quiet"]
    cases = [
        (["--dataset", "emoji", "--vq", vq, "--hflip"], "--hflip is for palette data sets"),
        (["--sparse-weight", "0.5"], "--sparse-weight applies only with --sparse-policy"),
        (["--sparse-policy", "diagonal", "--distill-cfg", "2", "--distill-pool", "512"],
         "--distill-pool, --distill-cfg apply only with --sparse-loss distill"),
        (["--out", str(afile)], "is a file, not a folder"),
        (["--out", "/proc/x"], "does not take new files"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--dataset", "emoji", "--vq", vq, "--device", "cuda"], "CUDA is not available"))
    # a checkpoint there: refused without --resume, and with another config, as train_gpt would (but before the data)
    from arsparse.training.trainer import CKPT_FORMAT

    (tmp_path / "old").mkdir()
    torch.save(dict(format=CKPT_FORMAT, config=dict(lr=123.0)), tmp_path / "old" / "ckpt.pt")
    cases += [(["--out", str(tmp_path / "old")], "ckpt.pt exists: resume from it"),
              (["--init-from", str(tmp_path / "none.safetensors")], "--init-from: no weights file at")]
    for extra, msg in cases:
        argv = base + extra + ([] if "--out" in extra else ["--out", str(tmp_path / "run")])
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("arsparse: error:") and msg in err and len(err.splitlines()) == 1, (argv, err)
    assert main(base + ["--out", str(tmp_path / "old"), "--resume"]) == 2
    err = capsys.readouterr().err  # (the error lists each setting that differs, a line each)
    assert "ckpt.pt was made with another config" in err and "lr: checkpoint 123.0" in err, err


def test_train_tokenizer_checks_its_output_and_checkpoint_before_the_data(tmp_path, capsys, monkeypatch):
    from arsparse.cli import main
    from arsparse.data import emoji

    def no_data(*a, **k):
        raise AssertionError("the data was loaded before the output was checked")

    monkeypatch.setattr(emoji, "load_emoji", no_data)
    (tmp_path / "old").mkdir()
    torch.save(dict(format="arsparse-vq-train/1", config={}), tmp_path / "old" / "ckpt.pt")
    base = ["train", "tokenizer", "--dataset", "emoji", "--steps", "2", "--quiet", "--out"]
    for out, msg in (("/proc/x", "does not take new files"), (str(tmp_path / "old"), "ckpt.pt exists: resume from it")):
        assert main(base + [out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("arsparse: error:") and msg in err, err
