"""Fine-tuning (init_from) and sparse-aware training (sparse_policy): the loss, the held-out numbers, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

from arsparse.checkpoint import CheckpointError
from arsparse.models.gpt import GPT
from arsparse.training import TrainConfig, train_gpt
from arsparse.training.trainer import make_batch

SPEC = "diagonal:local=2,rows=1,band=1,sinks=1"


def _cfg(out_dir, **kw) -> TrainConfig:
    args = dict(preset="GPT-tiny", vocab_size=16, num_classes=10, grid_h=6, grid_w=6, steps=1, batch_size=8,
                lr=3e-3, warmup=0, eval_every=1000, ckpt_every=1000, log_every=1, progress=False, export_dtype="fp32",
                seed=4)
    args.update(kw)
    return TrainConfig(out_dir=str(out_dir), **args)


def _data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    tokens = (torch.arange(36)[None] * (labels[:, None] + 1) + torch.randint(0, 3, (n, 36), generator=g)) % 16
    return tokens, labels


def _ce_bits(model, y, x, policy=None) -> float:
    logits = model.logits(y, x, policy=policy)
    return float(F.cross_entropy(logits.flatten(0, 1), x.flatten())) / math.log(2)


def test_a_sparse_aware_step_starts_from_the_given_weights_and_mixes_the_two_losses(tmp_path):
    """Step 0's logged loss == 0.7 x the cross-entropy under the policy's read sets + 0.3 x dense, both
    computed from the init_from weights (not a fresh init) through gpt.logits(policy=...) on the same batch."""
    tokens, labels = _data()
    cfg = _cfg(tmp_path / "run", sparse_policy=SPEC, sparse_weight=0.7, init_from=str(tmp_path / "w.pt"))
    start = GPT(cfg.gpt_config())
    with torch.no_grad():
        for p in start.parameters():
            p.normal_(0.0, 0.3)  # far from init_weights' draws: a run that ignored init_from would differ
    torch.save(start.state_dict(), tmp_path / "w.pt")
    x, y = make_batch(cfg, 0, tokens, labels)
    with torch.no_grad():
        want = 0.7 * _ce_bits(start, y, x, SPEC) + 0.3 * _ce_bits(start, y, x)
        assert abs(_ce_bits(start, y, x, SPEC) - _ce_bits(start, y, x)) > 1e-3  # the policy changes the loss
    got = train_gpt(cfg, tokens, labels, resume=False).history["train"][0]["train_bpt"]
    assert got == pytest.approx(want, rel=1e-5)


def test_held_out_losses_are_reported_both_ways_and_the_best_by_their_mix(tmp_path):
    tokens, labels = _data()
    val_tokens, val_labels = _data(16, seed=1)
    cfg = _cfg(tmp_path / "run", steps=4, eval_every=2, sparse_policy=SPEC, sparse_weight=0.25)
    result = train_gpt(cfg, tokens, labels, val_tokens, val_labels, resume=False)
    final = GPT(cfg.gpt_config())
    from arsparse.checkpoint import load_into, read_state_dict

    load_into(final, read_state_dict(result.model_path))
    final.eval()
    last = result.history["val"][-1]
    with torch.no_grad():
        dense, sparse = _ce_bits(final, val_labels, val_tokens), _ce_bits(final, val_labels, val_tokens, SPEC)
    assert last["step"] == 4 and result.final_val_bpt == last["val_bpt"]
    assert last["val_bpt"] == pytest.approx(dense, rel=1e-4) and last["val_bpt_sparse"] == pytest.approx(sparse, rel=1e-4)
    assert last["val_objective"] == pytest.approx(0.75 * dense + 0.25 * sparse, rel=1e-6)
    best = min(result.history["val"], key=lambda e: e["val_objective"])
    assert result.history["best"] == {"step": best["step"], "val_bpt": best["val_objective"]}
    from arsparse.training.trainer import read_train_meta

    header = read_train_meta(result.best_path)["val"][0]  # the best file says both losses, dense as val_bpt
    assert header == {k: v for k, v in best.items() if k != "time_s"}


def test_bad_sparse_training_settings_are_clear_errors(tmp_path):
    for kw, msg in ((dict(sparse_policy="h2o"), "must be an offset policy"),
                    (dict(sparse_policy="nope"), "sparse_policy: unknown policy 'nope'"),
                    (dict(sparse_policy=SPEC, sparse_weight=0.0), r"sparse_weight must be in \(0, 1\]")):
        with pytest.raises(ValueError, match=msg):
            _cfg(tmp_path / "run", **kw)
    tokens, labels = _data()
    with pytest.raises(FileNotFoundError, match="init_from: no weights file at"):
        train_gpt(_cfg(tmp_path / "run", init_from=str(tmp_path / "missing.pt")), tokens, labels, resume=False)
    other = GPT(_cfg(tmp_path / "x", grid_h=4, grid_w=4, vocab_size=12).gpt_config())
    torch.save(other.state_dict(), tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="tok_embeddings.weight"):
        train_gpt(_cfg(tmp_path / "run", init_from=str(tmp_path / "other.pt")), tokens, labels, resume=False)


def test_train_model_command_takes_the_flags_and_refuses_a_scored_policy(tmp_path, capsys):
    from arsparse.cli import main

    assert main(["train", "model", "--dataset", "fashion", "--out", str(tmp_path), "--sparse-policy", "h2o"]) == 2
    assert "sparse_policy must be an offset policy" in capsys.readouterr().err
    assert main(["train", "model", "--dataset", "fashion", "--out", str(tmp_path), "--sparse-policy", "diagonal",
                 "--sparse-weight", "1.5"]) == 2
    assert "sparse_weight must be in (0, 1]" in capsys.readouterr().err


def test_eval_takes_other_weights_for_a_bundle_and_refuses_ones_that_do_not_fit(tmp_path, capsys):
    """`arsparse eval --gpt-ckpt`: a model trained here (random-small's shape) evaluated with the bundle's
    tokenizer; one of another vocabulary is refused by name."""
    import json

    import arsparse
    from arsparse.checkpoint import save_safetensors
    from arsparse.cli import main
    from arsparse.loading import config_metadata

    gpt, _ = arsparse.load_model("random-small")
    with torch.no_grad():
        for p in gpt.parameters():
            p.mul_(1.5)
    save_safetensors(gpt.state_dict(), tmp_path / "tuned.safetensors", metadata=config_metadata(gpt.config))
    args = ["eval", "--model", "random-small", "--policies", "diagonal", "--num-samples", "2", "--nll-images", "2",
            "--no-mobilenet", "--quiet", "--device", "cpu", "--out", str(tmp_path / "ev")]
    assert main(args + ["--gpt-ckpt", str(tmp_path / "tuned.safetensors")]) == 0
    tuned = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert main(args) == 0
    plain = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert any("tuned.safetensors" in n for n in tuned["notes"]) and not any("gpt" in n.lower() for n in plain["notes"])
    assert tuned["rows"][0]["nll_bits_per_token"] != plain["rows"][0]["nll_bits_per_token"]
    other = GPT(_cfg(tmp_path / "x", vocab_size=12).gpt_config())
    save_safetensors(other.state_dict(), tmp_path / "other.safetensors", metadata=config_metadata(other.config))
    assert main(args + ["--gpt-ckpt", str(tmp_path / "other.safetensors")]) == 2
    assert "does not fit random-small's tokenizer and data: vocab_size 12" in capsys.readouterr().err
