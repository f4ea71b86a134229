"""Fine-tuning (init_from) and sparse-aware training (sparse_policy): the loss, the held-out numbers, bad input."""
import copy
import math
import re

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


def _start_weights(cfg, path, seed=0):
    """Weights far from init_weights' draws, saved at ``path`` (the run's init_from: the dense teacher)."""
    start = GPT(cfg.gpt_config())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in start.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    torch.save(start.state_dict(), path)
    return start.eval()


def _ce_bits(model, y, x, policy=None) -> float:
    logits = model.logits(y, x, policy=policy)
    return float(F.cross_entropy(logits.flatten(0, 1), x.flatten())) / math.log(2)


def test_a_sparse_aware_step_starts_from_the_given_weights_and_mixes_the_two_losses(tmp_path):
    """Step 0's logged loss == 0.7 x the cross-entropy under the policy's read sets + 0.3 x dense, both
    computed from the init_from weights (not a fresh init) through gpt.logits(policy=...) on the same batch."""
    tokens, labels = _data()
    cfg = _cfg(tmp_path / "run", sparse_policy=SPEC, sparse_weight=0.7, init_from=str(tmp_path / "w.pt"))
    start = _start_weights(cfg, tmp_path / "w.pt")  # (a run that ignored init_from would differ)
    x, y = make_batch(cfg, 0, tokens, labels)
    with torch.no_grad():
        want = 0.7 * _ce_bits(start, y, x, SPEC) + 0.3 * _ce_bits(start, y, x)
        assert abs(_ce_bits(start, y, x, SPEC) - _ce_bits(start, y, x)) > 1e-3  # the policy changes the loss
    got = train_gpt(cfg, tokens, labels, resume=False).history["train"][0]["train_bpt"]
    assert got == pytest.approx(want, rel=1e-5)


def test_a_split_step_trains_the_first_rows_under_the_policy_and_the_rest_dense(tmp_path):
    """sparse_mix "split", weight 0.6 of 8 rows: step 0's loss == 5/8 x the policy's cross-entropy on the batch's
    first 5 rows + 3/8 x dense on the other 3 (a different number from the "sum" mix of every row both ways),
    and the held-out objective weighs the two losses by those row shares."""
    tokens, labels = _data()
    val_tokens, val_labels = _data(16, seed=1)
    cfg = _cfg(tmp_path / "run", sparse_policy=SPEC, sparse_weight=0.6, sparse_mix="split", eval_every=1,
               init_from=str(tmp_path / "w.pt"))
    assert (cfg.sparse_rows, cfg.sparse_share) == (5, 5 / 8)
    start = _start_weights(cfg, tmp_path / "w.pt")
    x, y = make_batch(cfg, 0, tokens, labels)
    with torch.no_grad():
        want = 5 / 8 * _ce_bits(start, y[:5], x[:5], SPEC) + 3 / 8 * _ce_bits(start, y[5:], x[5:])
        summed = 0.6 * _ce_bits(start, y, x, SPEC) + 0.4 * _ce_bits(start, y, x)
    assert abs(want - summed) > 1e-3  # (the test tells the two mixes apart)
    result = train_gpt(cfg, tokens, labels, val_tokens, val_labels, resume=False)
    assert result.history["train"][0]["train_bpt"] == pytest.approx(want, rel=1e-5)
    val = result.history["val"][-1]
    assert val["val_objective"] == pytest.approx(3 / 8 * val["val_bpt"] + 5 / 8 * val["val_bpt_sparse"], rel=1e-6)


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
                    (dict(sparse_policy=SPEC, sparse_weight=0.0), r"sparse_weight must be in \(0, 1\]"),
                    (dict(sparse_policy=SPEC, sparse_mix="rows"), "sparse_mix must be one of sum, split, got 'rows'"),
                    (dict(sparse_policy=SPEC, sparse_weight=0.97, sparse_mix="split"),
                     r"0.97 x 8 leaves 8 of 8 rows; choose a sparse_weight that gives each share at least one row"),
                    (dict(sparse_policy=SPEC, sparse_weight=0.05, sparse_mix="split"), "leaves 0 of 8 rows"),
                    (dict(sparse_mix="split"), "sparse_mix 'split' needs sparse_policy")):
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


# ---- on-policy distillation (sparse_loss="distill") -------------------------------------------------

def _kl_ref(teacher, student, y, x, policy, scale=2.0, direction="reverse") -> float:
    """The KL divergence between the guided next-token distributions (u + scale (c - u), the null class 10
    for u) of the dense teacher and the student under the policy, through torch.distributions."""
    def guided(gpt, pol):
        c, u = gpt.logits(y, x, policy=pol).double(), gpt.logits(torch.full_like(y, 10), x, policy=pol).double()
        return torch.distributions.Categorical(logits=u + scale * (c - u))

    p, q = guided(teacher, None), guided(student, policy)
    return float(torch.distributions.kl_divergence(*((q, p) if direction == "reverse" else (p, q))).mean())


def test_kl_divergence_matches_torch_distributions_both_ways_and_trains_the_student_only():
    from arsparse.training.distill import kl_divergence

    for direction in ("reverse", "forward"):
        t = torch.randn(3, 5, 17, requires_grad=True)
        s = torch.randn(3, 5, 17, requires_grad=True)
        with torch.no_grad():
            p, q = torch.distributions.Categorical(logits=t.double()), torch.distributions.Categorical(logits=s.double())
            want = torch.distributions.kl_divergence(*((q, p) if direction == "reverse" else (p, q))).mean()
        got = kl_divergence(t, s, direction)
        assert float(got.detach()) == pytest.approx(float(want), rel=1e-5)
        got.backward()
        assert t.grad is None and s.grad is not None and s.grad.abs().sum() > 0
        assert float(kl_divergence(s, s, direction).detach()) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="direction must be"):
        kl_divergence(t, s, "both")


def test_the_distillation_pool_is_sampled_under_the_policy_from_the_current_weights(tmp_path):
    """Pool r == the Generator's samples (decode path, the policy's cache, guidance) of the weights at its
    refresh, with the pool's classes and keys; a new pool follows the weights as they change."""
    from arsparse.engine.generator import Generator
    from arsparse.training.distill import OnPolicyDistiller

    cfg = _cfg(tmp_path / "run", sparse_policy=SPEC, sparse_loss="distill", init_from=str(tmp_path / "w.pt"),
               distill_pool=16)
    model = _start_weights(cfg, tmp_path / "w.pt", seed=3).train()
    d = OnPolicyDistiller(model, torch.load(tmp_path / "w.pt"), SPEC, 16, 8, 2.0, torch.device("cpu"), seed=5)

    def sampled(weights, r, policy=SPEC):
        labels, keys = d.request(r)
        gen = Generator(copy.deepcopy(weights), device="cpu", dtype="fp32", policy=policy)
        return gen.sample_tokens(labels, cfg_scale=2.0, seed=keys), labels

    want, labels = sampled(model, 0)
    for step in (0, 1):  # two training steps per pool of 16
        x, y = d.batch_at(model, step)
        assert torch.equal(x, want[8 * step:8 * step + 8]) and torch.equal(y, labels[8 * step:8 * step + 8])
    assert not torch.equal(want, sampled(model, 0, policy=None)[0])  # (dense samples differ: the policy matters)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(-1.0)  # what training would do to the weights, grossly
    assert torch.equal(d.batch_at(model, 2)[0], sampled(model, 1)[0][:8])
    assert len(set(d.request(1)[1]) & set(d.request(0)[1])) == 0  # each pool its own keys


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_a_distillation_step_is_the_kl_to_the_dense_teacher_on_the_policys_samples(tmp_path, direction):
    """Step 0's logged loss == 0.6 x the KL between the guided distributions of the dense init_from and of
    the student under the policy, on the pool's first batch (torch.distributions), + 0.4 x dense
    cross-entropy on the data batch; its KL is logged too."""
    from arsparse.training.distill import OnPolicyDistiller

    tokens, labels = _data()
    cfg = _cfg(tmp_path / "run", sparse_policy=SPEC, sparse_weight=0.6, sparse_loss="distill",
               init_from=str(tmp_path / "w.pt"), distill_pool=8, distill_divergence=direction)
    start = _start_weights(cfg, tmp_path / "w.pt")
    xs, ys = OnPolicyDistiller(start, start.state_dict(), SPEC, 8, 8, 2.0, torch.device("cpu"), cfg.seed).batch_at(start, 0)
    x, y = make_batch(cfg, 0, tokens, labels)
    with torch.no_grad():
        kl = _kl_ref(start, start, ys, xs, SPEC, direction=direction)
        want = (0.6 * kl + 0.4 * _ce_bits(start, y, x) * math.log(2)) / math.log(2)
    row = train_gpt(cfg, tokens, labels, resume=False).history["train"][0]
    assert kl > 1e-3 and row["distill_kl_nats"] == pytest.approx(kl, rel=1e-4)
    assert row["train_bpt"] == pytest.approx(want, rel=1e-4)


def test_distillation_brings_the_policy_closer_to_the_dense_teacher(tmp_path):
    """40 steps of distillation alone (sparse_weight 1): the reverse KL between the guided distributions of
    the trained weights under the policy and of the dense teacher, on sequences those weights sample,
    falls well below where it started."""
    from arsparse.checkpoint import read_state_dict
    from arsparse.training.distill import OnPolicyDistiller

    tokens, labels = _data()
    cfg = _cfg(tmp_path / "run", steps=40, sparse_policy=SPEC, sparse_weight=1.0, sparse_loss="distill",
               init_from=str(tmp_path / "w.pt"), distill_pool=8, lr=3e-3)
    start = _start_weights(cfg, tmp_path / "w.pt", seed=1)
    tuned = GPT(cfg.gpt_config())
    tuned.load_state_dict(read_state_dict(train_gpt(cfg, tokens, labels, resume=False).model_path))
    tuned.eval()

    def kl_of(student):  # on 32 fresh samples of the student under the policy
        xs, ys = OnPolicyDistiller(student, start.state_dict(), SPEC, 32, 32, 2.0, torch.device("cpu"),
                                   seed=9).batch_at(student, 0)
        with torch.no_grad():
            return _kl_ref(start, student, ys, xs, SPEC)

    before, after = kl_of(start), kl_of(tuned)
    assert after < 0.8 * before, (before, after)  # (0.187 -> 0.111 nats on the CPU)


def test_bad_distillation_settings_are_clear_errors(tmp_path, capsys):
    for kw, msg in ((dict(sparse_loss="kl"), "sparse_loss must be one of data, distill"),
                    (dict(sparse_loss="distill", sparse_policy=SPEC), "needs sparse_policy (what the student reads) "
                                                                        "and init_from"),
                    (dict(sparse_loss="distill", sparse_policy=SPEC, init_from="w.pt", distill_pool=4),
                     "distill_pool must be an int >= batch_size (8)"),
                    (dict(sparse_loss="distill", sparse_policy=SPEC, init_from="w.pt", distill_cfg_scale=0.5),
                     "distill_cfg_scale must be >= 1"),
                    (dict(sparse_loss="distill", sparse_policy=SPEC, init_from="w.pt", distill_divergence="js"),
                     "distill_divergence must be one of reverse, forward")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            _cfg(tmp_path, **kw)
    from arsparse.cli import main

    assert main(["train", "model", "--dataset", "fashion", "--out", str(tmp_path / "x"), "--sparse-policy", "diagonal",
                 "--sparse-loss", "distill"]) != 0
    assert "init_from" in capsys.readouterr().err


def test_a_distillation_run_resumes_with_the_teacher_it_started_from(tmp_path):
    """Stopped after 3 steps and resumed: the run finishes, the teacher is still the init_from weights (the
    resumed step's logged KL == the reference from the checkpointed weights), and the pool of the
    resumed step is sampled from the weights it resumed with."""
    from arsparse.checkpoint import read_state_dict
    from arsparse.training.distill import OnPolicyDistiller
    from arsparse.training.trainer import load_checkpoint

    tokens, labels = _data()
    cfg = _cfg(tmp_path / "run", steps=5, sparse_policy=SPEC, sparse_weight=1.0, sparse_loss="distill",
               init_from=str(tmp_path / "w.pt"), distill_pool=16, log_every=1)
    start = _start_weights(cfg, tmp_path / "w.pt", seed=2)
    first = train_gpt(cfg, tokens, labels, stop_after=3)
    assert not first.finished and first.step == 3
    mid = GPT(cfg.gpt_config())
    mid.load_state_dict(load_checkpoint(first.ckpt_path)["model"])
    mid.eval()
    xs, ys = OnPolicyDistiller(mid, start.state_dict(), SPEC, 16, 8, 2.0, torch.device("cpu"),
                               cfg.seed).batch_at(mid, 3)  # (pool 1, second half: refreshed on resume)
    with torch.no_grad():
        want = _kl_ref(start, mid, ys, xs, SPEC)
    done = train_gpt(cfg, tokens, labels, resume=True)
    assert done.finished and done.step == 5 and read_state_dict(done.model_path)
    row = next(r for r in done.history["train"] if r["step"] == 4)
    assert row["distill_kl_nats"] == pytest.approx(want, rel=1e-4)
