import math

import pytest
import torch

from arsparse.models.config import GPTConfig, gpt_config
from arsparse.models.gpt import GPT
from arsparse.models.rope import apply_rope, rope_table
from conftest import random_cond, random_gpt


def rope_direct(x, pos, grid_w, prefix, base=10000.0):
    """Rotate one head vector x (D,) at sequence position pos, straight from the definition."""
    D = x.shape[0]
    if pos < prefix:
        return torch.zeros(D, dtype=torch.float64)
    r, c = divmod(pos - prefix, grid_w)
    out = torch.empty(D, dtype=torch.float64)
    for i in range(D // 2):
        j, coord = (i, r) if i < D // 4 else (i - D // 4, c)
        theta = coord * base ** (-2 * j / (D // 2))
        z = complex(x[2 * i], x[2 * i + 1]) * complex(math.cos(theta), math.sin(theta))
        out[2 * i], out[2 * i + 1] = z.real, z.imag
    return out


@pytest.mark.parametrize("head_dim,grid", [(8, (3, 4)), (100, (2, 3)), (64, (4, 4))])
def test_rope_matches_formula(head_dim, grid):
    prefix = 2
    gh, gw = grid
    table = rope_table(gh, gw, head_dim, 10000.0, prefix)
    T = prefix + gh * gw
    x = torch.randn(1, T, 3, head_dim)
    got = apply_rope(x, table)
    for pos in range(T):
        for h in range(3):
            want = rope_direct(x[0, pos, h].double(), pos, gw, prefix)
            torch.testing.assert_close(got[0, pos, h].double(), want, atol=1e-5, rtol=1e-5)


def test_presets_are_llamagen_sizes():
    sizes = {n: gpt_config(n).num_params() for n in ["GPT-B", "GPT-L", "GPT-XL", "GPT-XXL"]}
    # LlamaGen's stated sizes: 111M, 343M, 775M, 1.4B (c2i, 16384 codes, 1000 classes).
    assert abs(sizes["GPT-B"] / 111e6 - 1) < 0.02
    assert abs(sizes["GPT-L"] / 343e6 - 1) < 0.02
    assert abs(sizes["GPT-XL"] / 775e6 - 1) < 0.02
    assert abs(sizes["GPT-XXL"] / 1.41e9 - 1) < 0.02
    assert gpt_config("GPT-3B", model_type="t2i").head_dim == 100
    assert gpt_config("GPT-3B", model_type="t2i").cls_token_num == 120
    model = GPT(gpt_config("GPT-tiny", image_tokens=16, vocab_size=32, num_classes=5))
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()


@pytest.mark.parametrize("bad,msg", [
    (dict(dim=100, n_head=3), "divisible"),
    (dict(model_type="x2i"), "model_type"),
    (dict(n_kv_head=5), "n_kv_head"),
    (dict(dim=24, n_head=4), "multiple of 4"),
])
def test_config_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        GPTConfig(**{**dict(dim=64, n_head=4), **bad})


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="GPT-XL"):
        gpt_config("GPT-Z")
    with pytest.raises(ValueError, match="not a square"):
        gpt_config("GPT-B", image_tokens=300)


def test_logits_match_manual_forward(model_type):
    """gpt.logits equals an independent forward pass written out here (no backend, plain softmax)."""
    model = random_gpt(model_type)
    cfg = model.config
    cond = random_cond(model, 2)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.image_tokens))
    with torch.no_grad():
        got = model.logits(cond, tokens)
        h = torch.cat([model.embed_cond(cond), model.tok_embeddings(tokens[:, :-1])], 1)
        T = h.shape[1]
        table = rope_table(cfg.grid_h, cfg.grid_w, cfg.head_dim, cfg.rope_base, cfg.cls_token_num)[:T]
        causal = torch.ones(T, T).tril().bool()
        for layer in model.layers:
            a = layer.attention
            x = layer.attention_norm(h)
            q, k, v = a.wqkv(x).split(cfg.dim, -1)
            q = apply_rope(q.view(2, T, cfg.n_head, -1), table).transpose(1, 2)
            k = apply_rope(k.view(2, T, cfg.n_head, -1), table).transpose(1, 2)
            v = v.view(2, T, cfg.n_head, -1).transpose(1, 2)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
            p = s.masked_fill(~causal, float("-inf")).softmax(-1)
            h = h + a.wo((p @ v).transpose(1, 2).reshape(2, T, -1))
            f = layer.feed_forward
            y = layer.ffn_norm(h)
            h = h + f.w2(torch.nn.functional.silu(f.w1(y)) * f.w3(y))
        want = model.output(model.norm(h))[:, cfg.cls_token_num - 1 :]
    assert got.shape == (2, cfg.image_tokens, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_condition_positions_have_zero_queries_and_keys():
    """LlamaGen's zero rotation: prompt q/k vanish, so the first image token sees the prompt values evenly."""
    table = rope_table(2, 2, 16, 10000.0, 3)
    x = torch.randn(1, 7, 2, 16)
    out = apply_rope(x, table)
    assert out[:, :3].abs().max() == 0
    torch.testing.assert_close(out[:, 3], x[:, 3])  # cell (0, 0): zero angle, identity
    assert not torch.allclose(out[:, 6], x[:, 6])  # cell (1, 1) rotates


def test_bad_conditions_and_tokens():
    model = random_gpt("c2i")
    tokens = torch.randint(0, 48, (2, 16))
    with pytest.raises(ValueError, match=r"class labels must be in \[0, 7\]"):
        model.logits(torch.tensor([0, 9]), tokens)
    with pytest.raises(ValueError, match="1..16 columns"):
        model.logits(torch.tensor([0, 1]), torch.randint(0, 48, (2, 17)))
    with pytest.raises(ValueError, match="2 conditions for 3"):
        model.logits(torch.tensor([0, 1]), torch.randint(0, 48, (3, 4)))
    t2i = random_gpt("t2i")
    with pytest.raises(ValueError, match=r"\(B, 5, 12\)"):
        t2i.logits(torch.randn(2, 4, 12), tokens)


def test_teacher_forcing_refuses_token_ids_outside_the_vocabulary():
    """Out-of-vocabulary ids (inputs or the last, target-only column) are a ValueError naming [0, vocab), not an
    IndexError (or a CUDA assert) from the embedding or the loss."""
    model = random_gpt("c2i")  # vocab 48
    cond = torch.tensor([0, 1])
    for bad, col in [(48, 2), (-1, 2), (48, 3), (-1, 3), (1000, 0)]:
        tokens = torch.randint(0, 48, (2, 4))
        tokens[1, col] = bad
        for fn in (model.logits, model.loss, lambda c, t: model.logits(c, t, policy="dense")):
            with pytest.raises(ValueError, match=rf"token ids must be in \[0, 48\).*got {bad} "):
                fn(cond, tokens)
    with pytest.raises(ValueError, match="1..16 columns .*image tokens.*got 17"):
        model.loss(cond, torch.randint(0, 48, (2, 17)))
    with pytest.raises(ValueError, match=r"\(B, T\) integer tensor, got torch.float32"):
        model.logits(cond, torch.zeros(2, 4))
    assert model.loss(cond, torch.randint(0, 48, (2, 4))).isfinite()  # in range: as before


def _manifest(name):
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / f"llamagen_keys_{name}.json").read_text())


@pytest.mark.parametrize("model_type,name", [("c2i", "gpt_b_c2i"), ("t2i", "gpt_b_t2i")])
def test_state_dict_matches_llamagen_layout(model_type, name):
    """Key names and shapes equal those of LlamaGen's own GPT-B (manifest made from its code)."""
    model = GPT(gpt_config("GPT-B", image_tokens=256, model_type=model_type))
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == _manifest(name)


def test_llamagen_state_dict_loads_and_bad_ones_name_the_key(tmp_path):
    import arsparse
    from arsparse.checkpoint import CheckpointError

    ref = _manifest("gpt_b_c2i")
    sd = {k: torch.randn(s) * 0.02 for k, s in ref.items()}
    torch.save({"model": sd, "args": None}, tmp_path / "gpt_b.pt")
    model = arsparse.load_gpt(tmp_path / "gpt_b.pt", image_tokens=256)
    assert model.config.n_layer == 12 and model.config.num_classes == 1000
    torch.testing.assert_close(model.state_dict()["layers.3.attention.wqkv.weight"], sd["layers.3.attention.wqkv.weight"])

    bad = dict(sd)
    bad["layers.0.attention.wqkv_typo.weight"] = bad.pop("layers.0.attention.wqkv.weight")
    bad["layers.1.ffn_norm.weight"] = torch.randn(7)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        arsparse.load_gpt(tmp_path / "bad.pt", preset="GPT-B", image_tokens=256)
    msg = str(e.value)
    assert "layers.0.attention.wqkv.weight" in msg  # missing
    assert "layers.0.attention.wqkv_typo.weight" in msg  # unexpected
    assert "layers.1.ffn_norm.weight: expected (768,), got (7,)" in msg


def test_safetensors_with_config_metadata_roundtrip(tmp_path):
    import arsparse
    from arsparse.checkpoint import save_safetensors
    from arsparse.loading import config_metadata

    model = random_gpt("t2i")
    save_safetensors(model.state_dict(), tmp_path / "m.safetensors", config_metadata(model.config))
    again = arsparse.load_gpt(tmp_path / "m.safetensors")
    assert again.config == model.config
    cond = random_cond(model, 2)
    tokens = torch.randint(0, 48, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(again.logits(cond, tokens), model.logits(cond, tokens))
    torch.save(model.state_dict(), tmp_path / "m.pt")  # no metadata: the type is read off the keys
    with pytest.raises(ValueError, match="holds a t2i model"):
        arsparse.load_gpt(tmp_path / "m.pt", preset="GPT-tiny", image_tokens=16, model_type="c2i")


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_fused_blocks_equal_the_module_path(model_type):
    """GPT.fuse: the block as two functions of tensors (as the engine compiles it) == the modules.

    Traced by dynamo with fullgraph=True (backend "eager": no code generation on the CPU), so a
    graph break in either half fails here rather than on the GPU; GQA included.
    """
    from functools import partial

    from arsparse.engine.generator import Generator

    model = random_gpt(model_type, seed=5, n_kv_head=2)
    cond = random_cond(model, 3, seed=6)
    tokens = torch.randint(0, model.config.vocab_size, (3, model.config.image_tokens))
    with torch.no_grad():
        want = model.logits(cond, tokens)
        got = model.fuse(partial(torch.compile, backend="eager", fullgraph=True, dynamic=False)).logits(cond, tokens)
        model.unfuse()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if model_type == "c2i":  # and through the engine's cached decode path
        gen = Generator(model, device="cpu", dtype="fp32")
        ref = gen.cached_logits(cond, tokens)
        for compiler in (None, partial(torch.compile, backend="eager", fullgraph=True, dynamic=False)):
            model.fuse(compiler)  # (next_logits: the fused final norm + head, traced whole when compiled)
            torch.testing.assert_close(gen.cached_logits(cond, tokens), ref, atol=1e-5, rtol=1e-5)
        model.unfuse()


def test_merged_ffn_equals_the_module_path_and_unmerges():
    """fuse(merge_ffn=True): w1 and w3 as views into one tensor (no copy), one matrix product; the
    logits equal the module path's; a weight replaced afterwards is used as it is now; unfuse gives
    back separate storage."""
    from functools import partial

    model = random_gpt("c2i", seed=9, n_kv_head=2)
    cond = random_cond(model, 2, seed=3)
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.image_tokens))
    ff = model.layers[1].feed_forward
    w1, w3 = ff.w1.weight.detach().clone(), ff.w3.weight.detach().clone()
    with torch.no_grad():
        want = model.logits(cond, tokens)
        model.fuse(partial(torch.compile, backend="eager", fullgraph=True, dynamic=False), merge_ffn=True)
        assert ff.merged and torch.equal(ff.w13, torch.cat([w1, w3]))
        assert ff.w1.weight.data_ptr() == ff.w13.data_ptr()  # (views: no second copy of the weights)
        assert ff.w3.weight.data_ptr() == ff.w13[w1.shape[0]:].data_ptr()
        torch.testing.assert_close(model.logits(cond, tokens), want, atol=1e-5, rtol=1e-5)
        ff.w3.weight.data = torch.randn_like(w3)  # (reassigned: no longer the view) -> the new weight counts
        assert not ff.merged
        moved = model.logits(cond, tokens)
        assert not torch.allclose(moved, want, atol=1e-3)
        model.unfuse()
        torch.testing.assert_close(model.logits(cond, tokens), moved, atol=1e-5, rtol=1e-5)
        model.fuse(None, merge_ffn=True)
        model.unfuse()
    assert ff.w13 is None and ff.w1.weight.untyped_storage().data_ptr() != ff.w3.weight.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="merge_ffn applies to the built-in halves only"):
        model.fuse(None, halves=(None, None, None), merge_ffn=True)


def test_unknown_compile_mode_is_refused_by_name():
    from arsparse.engine.generator import COMPILE_MODES, Generator

    model = random_gpt("c2i", seed=2)
    with pytest.raises(ValueError, match="unknown compile mode 'reduce-overhead'.*" + COMPILE_MODES[-1]):
        Generator(model, device="cpu", dtype="fp32", compile="reduce-overhead")
    assert Generator(model, device="cpu", dtype="fp32", compile=False).compile is False
