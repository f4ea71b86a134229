"""Training with dropout (flags, exact resume, inference exports) and best-checkpoint selection (kept, resumed, shipped)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import arsparse
from arsparse.loading import GPT_META, config_metadata, read_metadata
from arsparse.models.config import DROPOUT_FIELDS, GPTConfig
from arsparse.training import TrainConfig, load_checkpoint, recipe_config, train_gpt
from arsparse.training import trainer as T

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = Path(arsparse.__file__).parent / "weights"


@pytest.mark.parametrize("field", DROPOUT_FIELDS)
def test_dropout_fields_are_validated(field):
    for bad in (-0.1, 1.0, "0.1"):
        with pytest.raises(ValueError, match=rf"TrainConfig: bad architecture.*{field} must be a number in \[0, 1\)"):
            TrainConfig(out_dir="x", **{field: bad})


def test_recipes_keep_the_shipped_architectures():
    for name in ("fashion-c2i", "emoji-c2i"):
        shipped = GPTConfig(**json.loads(read_metadata(WEIGHTS / f"{name}.safetensors")[GPT_META]))
        assert recipe_config(name, "x").gpt_config().without_dropout() == shipped
    # fashion's recipe is still exactly the shipped run's (no dropout); emoji's is regularised
    assert recipe_config("fashion-c2i", "x").gpt_config() == GPTConfig(
        **json.loads(read_metadata(WEIGHTS / "fashion-c2i.safetensors")[GPT_META]))
    emoji = recipe_config("emoji-c2i", "x")
    assert (emoji.token_dropout_p, emoji.resid_dropout_p, emoji.ffn_dropout_p, emoji.attn_dropout_p) == (.1, .1, .1, 0)


# ---- the trainer: dropout flags, best-checkpoint selection -----------------------------------------

def tiny_cfg(out_dir, **kw) -> TrainConfig:
    args = dict(preset="GPT-tiny", vocab_size=16, num_classes=10, grid_h=4, grid_w=4, steps=10, batch_size=8,
                lr=3e-3, warmup=2, eval_every=2, ckpt_every=1000, log_every=5, progress=False, export_dtype="fp32")
    args.update(kw)
    return TrainConfig(out_dir=str(out_dir), **args)


def synthetic(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    return (torch.arange(16)[None] * (labels[:, None] + 1) + torch.randint(0, 2, (n, 16), generator=g)) % 16, labels


@pytest.fixture
def scripted_val(monkeypatch):
    """Scripted held-out losses: the n-th call of evaluate() returns ``losses["values"][n]``; ``seen`` counts calls."""
    losses = {}
    seen = []

    def fake(model, tokens, labels, batch_size, bf16):
        step = len(seen)
        seen.append(step)
        return losses["values"][step]

    monkeypatch.setattr(T, "evaluate", fake)
    return losses, seen


def state_of(path):
    return arsparse.load_gpt(path).state_dict()


def test_dropout_trains_resumes_exactly_and_exports_without_it(tmp_path):
    tokens, labels = synthetic()
    cfg = dict(token_dropout_p=0.1, resid_dropout_p=0.1, ffn_dropout_p=0.1, drop_path_rate=0.1, eval_every=1000)
    straight = train_gpt(tiny_cfg(tmp_path / "a", **cfg), tokens, labels)
    plain = train_gpt(tiny_cfg(tmp_path / "p", eval_every=1000), tokens, labels)
    assert train_gpt(tiny_cfg(tmp_path / "b", **cfg), tokens, labels, stop_after=4).step == 4
    resumed = train_gpt(tiny_cfg(tmp_path / "b", **cfg), tokens, labels)
    a, b, p = (load_checkpoint(r.ckpt_path)["model"] for r in (straight, resumed, plain))
    for k in a:  # the dropout masks come back with the RNG state
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-7, msg=k)
    assert not torch.allclose(a["layers.0.feed_forward.w2.weight"], p["layers.0.feed_forward.w2.weight"])
    meta = read_metadata(straight.model_path)
    assert not set(json.loads(meta[GPT_META])) & set(DROPOUT_FIELDS)  # an inference file
    assert json.loads(meta["arsparse.train"])["dropout"] == {k: 0.1 for k in cfg if k != "eval_every"}
    assert arsparse.load_gpt(straight.model_path).config == tiny_cfg("x").gpt_config()
    # without dropout the exported header is what it was before dropout and best selection existed
    assert set(json.loads(read_metadata(plain.model_path)["arsparse.train"])) == {"step", "steps", "dataset", "seed",
                                                                                "val"}


def test_best_checkpoint_is_kept_survives_resume_and_matches_that_step(tmp_path, scripted_val):
    losses, seen = scripted_val
    # evaluations at steps 2, 4, 6, 8 and the end (10): down, then up -> best at step 4
    losses["values"] = [3.0, 2.0, 2.5, 2.9, 3.5]
    tokens, labels = synthetic()
    val = (tokens[:8], labels[:8])
    first = train_gpt(tiny_cfg(tmp_path), tokens, labels, *val, stop_after=4)
    assert first.step == 4 and first.best_path == tmp_path / "best.safetensors"
    at_step_4 = load_checkpoint(first.ckpt_path)["model"]
    head = json.loads(read_metadata(first.best_path)["arsparse.train"])
    assert (head["step"], head["selected"], head["val"]) == (4, "best", [{"step": 4, "val_bpt": 2.0}])

    done = train_gpt(tiny_cfg(tmp_path), tokens, labels, *val)  # resumes from ckpt.pt at step 4
    assert done.finished and seen == [0, 1, 2, 3, 4] and done.history["best"] == {"step": 4, "val_bpt": 2.0}
    assert json.loads((tmp_path / "train_log.json").read_text())["history"]["best"]["step"] == 4
    best, last = state_of(done.best_path), state_of(done.model_path)
    for k, v in at_step_4.items():
        assert torch.equal(best[k], v), k
    assert not torch.equal(last["output.weight"], best["output.weight"])
    assert json.loads(read_metadata(done.best_path)["arsparse.train"])["step"] == 4

    (tmp_path / "fresh").mkdir()  # a fresh run in a folder with a stale best.safetensors removes it
    shutil.copyfile(done.best_path, tmp_path / "fresh" / "best.safetensors")
    no_val = train_gpt(tiny_cfg(tmp_path / "fresh", steps=2), tokens, labels)
    assert no_val.best_path is None and not (tmp_path / "fresh" / "best.safetensors").exists()


def test_best_lost_over_a_resume_elsewhere_is_said(tmp_path, scripted_val):
    losses, _ = scripted_val
    losses["values"] = [3.0, 2.0, 2.5, 2.4, 2.2]
    tokens, labels = synthetic()
    val = (tokens[:8], labels[:8])
    train_gpt(tiny_cfg(tmp_path / "a"), tokens, labels, *val, stop_after=6)  # best at 4, checkpoint at 6
    (tmp_path / "b").mkdir()
    T.portable_checkpoint(tmp_path / "a" / "ckpt.pt", tmp_path / "b" / "ckpt.pt", dtype="fp32")  # without best
    with pytest.warns(UserWarning, match=r"best held-out, 2.0000 bits/token at step 4\) is missing.*again at step 6"):
        done = train_gpt(tiny_cfg(tmp_path / "b"), tokens, labels, *val)
    assert done.history["best"] == {"step": 10, "val_bpt": 2.2} and done.history["best_since"] == 6
    head = json.loads(read_metadata(done.best_path)["arsparse.train"])
    assert head["best_since"] == 6
    from arsparse.training.card import _shipped_text

    assert _shipped_text(head, done.history["val"], 10) == (
        "; best 2.000 at step 4; shipped: step 10 (best held-out from step 6 on, 2.200: the best weights of the "
        "earlier steps were not carried over a resume).")


def test_export_ships_the_best_and_the_card_says_which_step(tmp_path, scripted_val, monkeypatch):
    """`arsparse train export`: best.safetensors by default, --ship last the last step; the card names the step."""
    import hashlib

    from arsparse.checkpoint import save_safetensors
    from arsparse.models.vq import VQModel, vq_config
    from arsparse.training import card
    from arsparse.training.cli import main

    losses, _ = scripted_val
    losses["values"] = [3.0, 2.0, 2.5, 2.9, 3.5]
    vq_dir = tmp_path / "vq"
    vq_dir.mkdir()
    vq = VQModel(vq_config("VQ-16", ch=32, codebook_size=16))
    save_safetensors(vq.state_dict(), vq_dir / "emoji-vq.safetensors", config_metadata(vq.config))
    shutil.copyfile(REPO / "docs/models/emoji-vq-train_log.json", vq_dir / "train_log.json")
    sha = hashlib.sha256((vq_dir / "emoji-vq.safetensors").read_bytes()).hexdigest()
    tokens, labels = synthetic()
    cfg = tiny_cfg(tmp_path / "gpt", tokenizer={"type": "vq", "file": "emoji-vq.safetensors", "sha256": sha},
                   dataset="synthetic", export_dtype="fp16")
    res = train_gpt(cfg, tokens, labels, tokens[:8], labels[:8])
    monkeypatch.setattr(card, "sample_grid", lambda gpt, tok, path, *a, **k: path.write_bytes(b"png") and path)

    common = ["export", "--gpt-dir", str(tmp_path / "gpt"), "--vq-dir", str(vq_dir), "--cfg-scales", "3",
              "--device", "cpu", "--quiet"]
    assert main([*common, "--out", str(tmp_path / "best")]) == 0
    shipped = tmp_path / "best" / "emoji-c2i.safetensors"
    assert shipped.read_bytes() == res.best_path.read_bytes()
    text = (tmp_path / "best" / "emoji-c2i.md").read_text()
    assert "best 2.000 at step 4; shipped: step 4 (best held-out at step 4, chosen by best-checkpoint selection)" in text

    assert main([*common, "--out", str(tmp_path / "last"), "--ship", "last"]) == 0
    assert (tmp_path / "last" / "emoji-c2i.safetensors").read_bytes() == res.model_path.read_bytes()
    assert "best 2.000 at step 4; shipped: step 10 (the last step)." in (tmp_path / "last" / "emoji-c2i.md").read_text()

    res.best_path.unlink()  # a run from before best-checkpoint selection: the last, with a warning
    with pytest.warns(UserWarning, match="shipping the last step"):
        assert main([*common, "--out", str(tmp_path / "old")]) == 0
    assert "shipped: step 10 (the last step)" in (tmp_path / "old" / "emoji-c2i.md").read_text()


def test_cli_dropout_flags(tmp_path):
    import argparse

    from arsparse.training.cli import _add_subcommands, _dropouts

    p = argparse.ArgumentParser()
    _add_subcommands(p)
    a = p.parse_args(["model", "--dropout", "0.2", "--ffn-dropout", "0", "--drop-path", "0.05"])
    assert _dropouts(a) == dict(token_dropout_p=0.2, resid_dropout_p=0.2, ffn_dropout_p=0.0, drop_path_rate=0.05)
    assert set(_dropouts(p.parse_args(["model"])).values()) == {None}  # the recipe's
    assert p.parse_args(["export", "--out", "x"]).ship == "best"
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["model", "--dropout", bad])


def test_old_checkpoints_without_dropout_fields_resume(tmp_path):
    tokens, labels = synthetic()
    train_gpt(tiny_cfg(tmp_path, eval_every=1000), tokens, labels, stop_after=3)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    for f in DROPOUT_FIELDS:
        del ckpt["config"][f], ckpt["gpt_config"][f]
    torch.save(ckpt, tmp_path / "ckpt.pt")
    assert train_gpt(tiny_cfg(tmp_path, eval_every=1000), tokens, labels).finished
    with pytest.raises(ValueError, match="ffn_dropout_p: checkpoint 0.0, now 0.1"):
        train_gpt(tiny_cfg(tmp_path, eval_every=1000, ffn_dropout_p=0.1), tokens, labels)
