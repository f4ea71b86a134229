"""LlamaGen's dropouts in the GPT: active in train mode only; eval, cached decode and fused paths untouched."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import arsparse
from arsparse.engine.generator import Generator
from arsparse.loading import GPT_META, config_metadata, read_metadata
from arsparse.models.config import DROPOUT_FIELDS, GPTConfig
from arsparse.models.gpt import GPT, drop_path
from conftest import random_cond, random_gpt

WEIGHTS = Path(arsparse.__file__).parent / "weights"

ALL = dict(token_dropout_p=0.3, attn_dropout_p=0.3, resid_dropout_p=0.3, ffn_dropout_p=0.3, drop_path_rate=0.6)


def twins(model_type="c2i", **dropouts):
    """A tiny GPT with the given dropouts and a dropout-free one with the same (random) weights."""
    ref = random_gpt(model_type, seed=11)
    drop = GPT(replace(ref.config, **dropouts))
    drop.load_state_dict(ref.state_dict(), strict=True)  # dropouts add no keys
    return drop.eval(), ref


def forward(model, cond, tokens, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.logits(cond, tokens)


# ---- the model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dropouts", [{f: ALL[f]} for f in DROPOUT_FIELDS] + [ALL], ids=[*DROPOUT_FIELDS, "all"])
def test_each_dropout_acts_in_train_mode_only(dropouts):
    drop, ref = twins(**dropouts)
    cond, tokens = random_cond(ref, 4, seed=2), torch.randint(0, ref.config.vocab_size, (4, ref.config.image_tokens))
    want = forward(ref, cond, tokens)
    assert torch.equal(forward(drop, cond, tokens), want)  # eval: the dropout-free model's outputs exactly
    drop.train()
    a, b, a2 = forward(drop, cond, tokens, 1), forward(drop, cond, tokens, 2), forward(drop, cond, tokens, 1)
    assert not torch.allclose(a, b) and not torch.allclose(a, want)  # random in training...
    assert torch.equal(a, a2)  # ...and a function of the torch RNG
    assert torch.equal(forward(ref.train(), cond, tokens, 1), want)  # a dropout-free model: train == eval
    assert torch.equal(forward(drop.eval(), cond, tokens), want)


def test_drop_path_drops_whole_rows_and_keeps_the_mean():
    torch.manual_seed(0)
    x = torch.rand(4000, 3, 5) + 0.5
    y = drop_path(x, 0.25)
    kept = (y != 0).flatten(1)
    assert (kept.all(1) | ~kept.any(1)).all()  # each row kept or dropped as a whole
    assert abs(kept.all(1).float().mean().item() - 0.75) < 0.03
    torch.testing.assert_close(y[kept.all(1)], x[kept.all(1)] / 0.75)
    drop = GPT(replace(random_gpt().config, drop_path_rate=0.3, n_layer=4))
    assert [layer.drop_path_p for layer in drop.layers] == pytest.approx([0.0, 0.1, 0.2, 0.3])  # LlamaGen's ramp


def test_cached_decode_and_fused_paths_ignore_dropout():
    drop, ref = twins(**ALL)
    cond = random_cond(ref, 3, seed=4)
    tokens = torch.randint(0, ref.config.vocab_size, (3, ref.config.image_tokens))
    want = Generator(ref, device="cpu", dtype="fp32").cached_logits(cond, tokens)
    gen = Generator(drop.train(), device="cpu", dtype="fp32")  # the engine puts the model in eval mode
    assert not drop.training
    torch.testing.assert_close(gen.cached_logits(cond, tokens), want, rtol=0, atol=0)
    toks = Generator(ref, device="cpu", dtype="fp32").sample_tokens(cond, cfg_scale=2.0, seed=7)
    assert torch.equal(gen.sample_tokens(cond, cfg_scale=2.0, seed=7), toks)
    # the fused pure functions have no dropout, even in train mode
    full = forward(ref, cond, tokens)
    drop.fuse(None).train()
    torch.testing.assert_close(forward(drop, cond, tokens, 3), full, rtol=1e-5, atol=1e-5)
    drop.unfuse()
    assert not torch.allclose(forward(drop, cond, tokens, 3), full)


@pytest.mark.parametrize("field", DROPOUT_FIELDS)
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, True, "0.1", None])
def test_dropout_config_validation(field, bad):
    with pytest.raises(ValueError, match=rf"{field} must be a number in \[0, 1\).*got {bad!r}"):
        GPTConfig(dim=64, n_head=4, **{field: bad})


def test_headers_without_dropout_are_unchanged_and_shipped_configs_load():
    cfg = random_gpt().config
    assert not set(json.loads(config_metadata(cfg)[GPT_META])) & set(DROPOUT_FIELDS)
    header = json.loads(config_metadata(replace(cfg, ffn_dropout_p=0.1))[GPT_META])
    assert header["ffn_dropout_p"] == 0.1 and GPTConfig(**header).ffn_dropout_p == 0.1
    for name in ("fashion-c2i", "emoji-c2i"):  # headers written before dropout existed
        shipped = GPTConfig(**json.loads(read_metadata(WEIGHTS / f"{name}.safetensors")[GPT_META]))
        assert all(getattr(shipped, f) == 0 for f in DROPOUT_FIELDS)
        assert arsparse.load_gpt(WEIGHTS / f"{name}.safetensors").config == shipped
