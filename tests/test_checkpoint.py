"""Tests for checkpoint reading, strict loading and safetensors writing."""

import argparse

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

from arsparse.checkpoint import CheckpointError, convert, load_into, read_state_dict, save_safetensors
from arsparse.models.vq import VQModel, vq_config
from arsparse.tokenizers import VQTokenizer


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.norm = nn.LayerNorm(6)
        self.register_buffer("steps", torch.zeros(3))


def fresh(seed):
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():
        for t in m.state_dict().values():
            t.copy_(torch.randn(t.shape))
    return m


@pytest.fixture
def source():
    return fresh(1).state_dict()


def _prefix(sd, p):
    return {p + k: v for k, v in sd.items()}


LAYOUTS = {
    "raw": lambda sd: dict(sd),
    "model": lambda sd: {"model": sd, "optimizer": {"lr": 1e-4}, "steps": 100,
                         "args": argparse.Namespace(gpt_model="GPT-B", lr=1e-4)},
    "module": lambda sd: {"module": sd, "global_steps": 7},
    "state_dict": lambda sd: {"state_dict": sd, "epoch": 3},
    "module-prefix": lambda sd: _prefix(sd, "module."),
    "compiled-ddp-under-model": lambda sd: {"model": _prefix(sd, "module._orig_mod.")},
}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("ext", [".pt", ".pth", ".bin"])
def test_torch_roundtrip_each_layout(tmp_path, source, layout, ext):
    path = tmp_path / f"ckpt{ext}"
    torch.save(LAYOUTS[layout](source), path)
    sd = read_state_dict(path)
    assert_same(sd, source)
    target = fresh(2)
    assert not torch.equal(target.emb.weight, source["emb.weight"])
    assert load_into(target, sd, what="Tiny") == []
    assert_same(target.state_dict(), source)


@pytest.mark.parametrize("layout", ["raw", "module-prefix"])
def test_safetensors_roundtrip(tmp_path, source, layout):
    path = tmp_path / "w.safetensors"
    save_safetensors(LAYOUTS[layout](source), path, metadata={"arch": "tiny"})
    sd = read_state_dict(path)
    assert_same(sd, source)
    target = fresh(3)
    load_into(target, sd, what="Tiny")
    assert_same(target.state_dict(), source)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"arch": "tiny"}


def test_ema_only_on_request(tmp_path, source):
    ema = fresh(9).state_dict()
    path = tmp_path / "vq.pt"
    torch.save({"model": source, "ema": ema}, path)
    assert_same(read_state_dict(path), source)
    assert_same(read_state_dict(path, key="ema"), ema)
    only_ema = tmp_path / "ema.pt"
    torch.save({"ema": ema, "steps": 1}, only_ema)
    with pytest.raises(CheckpointError, match="key='ema'"):
        read_state_dict(only_ema)
    with pytest.raises(CheckpointError, match="no entry 'generator'.*'model'.*'ema'"):
        read_state_dict(path, key="generator")


def test_mismatch_error_names_every_problem(source):
    bad = dict(source)
    bad["blocks.0.weight_renamed"] = bad.pop("blocks.0.weight")
    bad["extra.bias"] = torch.randn(4)
    bad["norm.weight"] = torch.randn(7)
    target = fresh(2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_into(target, bad, what="Tiny")
    msg = str(info.value)
    assert "Tiny checkpoint does not match" in msg
    assert "1 missing" in msg and "blocks.0.weight\n" in msg
    assert "2 unexpected" in msg and "blocks.0.weight_renamed" in msg and "extra.bias" in msg
    assert "1 shape mismatches" in msg and "norm.weight: expected (6,), got (7,)" in msg
    assert_same(target.state_dict(), before)  # nothing was loaded
    assert isinstance(info.value, ValueError)


def test_mismatch_listing_is_truncated():
    big = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(50))
    with pytest.raises(CheckpointError) as info:
        load_into(big, {"x": torch.randn(1)}, what="Big")
    msg = str(info.value)
    assert "50 missing" in msg and "... and 30 more" in msg
    assert msg.count(".weight") == 20


def test_optional_and_ignored_keys():
    torch.manual_seed(0)
    vq = VQModel(vq_config("VQ-8", ch=32, z_channels=32, codebook_size=64))
    sd = {k: torch.randn_like(v) for k, v in vq.state_dict().items()}
    del sd["quantize.codebook_used"]
    sd["freqs_cis"] = torch.randn(4, 2)
    target = VQModel(vq_config("VQ-8", ch=32, z_channels=32, codebook_size=64))
    assert load_into(target, sd, what="VQ") == ["quantize.codebook_used"]
    assert torch.equal(target.quantize.embedding.weight, sd["quantize.embedding.weight"])
    # the same key is required when not declared optional
    with pytest.raises(CheckpointError, match="quantize.codebook_used"):
        load_into(target, sd, what="VQ", optional=())


def test_load_casts_to_module_dtype(source):
    half = {k: v.half() for k, v in source.items()}
    target = fresh(2)
    load_into(target, half, what="Tiny")
    for k, v in target.state_dict().items():
        assert v.dtype == torch.float32
        assert torch.equal(v, half[k].float())


def test_save_handles_shared_and_strided_tensors(tmp_path):
    base = torch.randn(4, 6)
    sd = {"a": base, "tied": base, "view": base[:, ::2], "t": base.T}
    path = tmp_path / "out" / "shared.safetensors"
    save_safetensors(sd, path)
    back = read_state_dict(path)
    assert_same(back, {k: v.contiguous() for k, v in sd.items()})
    assert not list(path.parent.glob("*.tmp"))


def test_convert(tmp_path, source):
    src = tmp_path / "gpt.pt"
    torch.save({"model": _prefix(source, "module."), "args": argparse.Namespace(x=1)}, src)
    dst = tmp_path / "gpt.safetensors"
    assert convert(src, dst) == len(source)
    assert_same(read_state_dict(dst), source)
    with safe_open(str(dst), "pt") as f:
        assert f.metadata()["source"] == "gpt.pt"
    # a safetensors source keeps its header (the configs load_gpt rebuilds a model from); no file over itself
    meta = {"arsparse.gpt": '{"dim": %d}' % torch.randint(8, 99, ()).item(), "note": "x"}
    save_safetensors(source, tmp_path / "a.safetensors", meta)
    assert convert(tmp_path / "a.safetensors", tmp_path / "b.safetensors") == len(source)
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        assert {k: f.metadata()[k] for k in meta} == meta and f.metadata()["source"] == "a.safetensors"
    assert_same(read_state_dict(tmp_path / "b.safetensors"), source)
    with pytest.raises(CheckpointError, match="must be another file than the input"):
        convert(tmp_path / "a.safetensors", tmp_path / "." / "a.safetensors")
    with pytest.raises(CheckpointError, match="does not take new files"):  # (before the input is read)
        convert(tmp_path / "nope.pt", "/proc/arsparse-test.safetensors")


def test_vq_tokenizer_from_checkpoint(tmp_path):
    cfg = vq_config("VQ-8", ch=32, z_channels=32, codebook_size=64)
    torch.manual_seed(4)
    model = VQModel(cfg)
    path = tmp_path / "vq.pt"
    torch.save({"model": model.state_dict(), "ema": {}}, path)
    tok = VQTokenizer.from_checkpoint(path, cfg)
    x = torch.randn(1, 3, 16, 16).clamp(-1, 1)
    assert torch.equal(tok.encode(x), model.eval().encode_indices(x))


def test_read_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        read_state_dict(tmp_path / "nope.pt")
    odd = tmp_path / "weights.npz"
    odd.write_bytes(b"123")
    with pytest.raises(CheckpointError, match="unknown checkpoint extension '.npz'"):
        read_state_dict(odd)
    empty = tmp_path / "meta.pt"
    torch.save({"steps": 3, "args": argparse.Namespace(a=1)}, empty)
    with pytest.raises(CheckpointError, match="no state dict of tensors.*'steps'"):
        read_state_dict(empty)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="torch.load"):
        read_state_dict(garbage)
    bad_st = tmp_path / "bad.safetensors"
    bad_st.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="safetensors"):
        read_state_dict(bad_st)


def test_unsafe_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.randn(2)}, "obj": Tiny}, path)
    with pytest.raises(CheckpointError, match="weights_only"):
        read_state_dict(path)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(CheckpointError, match="must end in .safetensors"):
        save_safetensors({"a": torch.randn(2)}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match="str to str"):
        save_safetensors({"a": torch.randn(2)}, tmp_path / "a.safetensors", metadata={"n": 1})
    with pytest.raises(CheckpointError, match="only str -> Tensor"):
        save_safetensors({"a": 1.0}, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match="no tensors"):
        save_safetensors({}, tmp_path / "a.safetensors")


def test_arguments_that_disagree_with_a_config_header_are_refused(tmp_path):
    """A file with a config header ignored preset=/model_type= (and load_vq's overrides) silently: now one that
    disagrees is a CheckpointError naming both, and one that agrees loads as before."""
    import arsparse
    from arsparse.loading import config_metadata
    from conftest import random_gpt

    gpt = random_gpt("c2i", image_tokens=16)  # GPT-tiny
    save_safetensors(gpt.state_dict(), tmp_path / "g.safetensors", config_metadata(gpt.config))
    with pytest.raises(CheckpointError, match=r"preset='GPT-B' \(n_layer=12, n_head=12, dim=768\) disagrees with the "
                                              r"config in the header of .*g.safetensors \(n_layer=2, n_head=4, dim=64\)"):
        arsparse.load_gpt(tmp_path / "g.safetensors", preset="GPT-B")
    with pytest.raises(CheckpointError, match=r"model_type='t2i' disagrees .*\(model_type='c2i'\)"):
        arsparse.load_gpt(tmp_path / "g.safetensors", model_type="t2i")
    with pytest.raises(ValueError, match="unknown GPT preset 'GPT-Q'"):
        arsparse.load_gpt(tmp_path / "g.safetensors", preset="GPT-Q")
    again = arsparse.load_gpt(tmp_path / "g.safetensors", preset="GPT-tiny", model_type="c2i", image_tokens=16)
    assert again.config == gpt.config

    vq = VQModel(vq_config("VQ-16", ch=32, codebook_size=48))
    save_safetensors(vq.state_dict(), tmp_path / "v.safetensors", config_metadata(vq.config))
    with pytest.raises(CheckpointError, match=r"preset='VQ-8' \(encoder_ch_mult=\(1, 2, 2, 4\).*disagrees .*"
                                              r"\(encoder_ch_mult=\(1, 1, 2, 2, 4\)"):
        arsparse.load_vq(tmp_path / "v.safetensors", preset="VQ-8")
    with pytest.raises(CheckpointError, match=r"codebook_size=64 disagrees .*\(codebook_size=48\).*leave codebook_size out"):
        arsparse.load_vq(tmp_path / "v.safetensors", codebook_size=64)
    for kw in ({}, dict(preset="VQ-16"), dict(codebook_size=48, ch_mult=[1, 1, 2, 2, 4])):
        assert arsparse.load_vq(tmp_path / "v.safetensors", **kw).model.config == vq.config
    torch.save(vq.state_dict(), tmp_path / "v.pt")  # weights only: preset (default VQ-16) and overrides size it
    assert arsparse.load_vq(tmp_path / "v.pt", ch=32).model.config == vq.config


def test_load_takes_the_device_and_dtype_spellings_of_the_command_line(tmp_path):
    """load_gpt(dtype='bf16') and device='gpu' were raw torch errors: the CLI's spellings load, others are named."""
    import arsparse
    from arsparse.loading import config_metadata
    from conftest import random_gpt

    gpt = random_gpt("c2i", image_tokens=16)
    save_safetensors(gpt.state_dict(), tmp_path / "g.safetensors", config_metadata(gpt.config))
    vq = VQModel(vq_config("VQ-16", ch=32, codebook_size=48))
    save_safetensors(vq.state_dict(), tmp_path / "v.safetensors", config_metadata(vq.config))
    for spelling, dtype in [("bf16", torch.bfloat16), ("fp16", torch.float16), ("float32", torch.float32),
                            (torch.bfloat16, torch.bfloat16), (None, torch.float32)]:
        assert arsparse.load_gpt(tmp_path / "g.safetensors", dtype=spelling).dtype == dtype
    assert arsparse.load_gpt(tmp_path / "g.safetensors", device=torch.device("cpu")).output.weight.device.type == "cpu"
    with pytest.raises(ValueError, match=r"unknown dtype 'bfloat'; choose one of \['bf16'"):
        arsparse.load_gpt(tmp_path / "g.safetensors", dtype="bfloat")
    with pytest.raises(ValueError, match="dtype must be a floating-point type .*got torch.int64"):
        arsparse.load_gpt(tmp_path / "g.safetensors", dtype=torch.int64)
    for load in (lambda: arsparse.load_gpt(tmp_path / "g.safetensors", device="gpu"),
                 lambda: arsparse.load_vq(tmp_path / "v.safetensors", device="gpu"),
                 lambda: arsparse.load_model(device="gpu")):
        with pytest.raises(ValueError, match="unknown device 'gpu': use cpu, cuda or cuda:N"):
            load()
    assert arsparse.load_model(dtype="bf16")[0].dtype == torch.bfloat16  # (a shipped bundle: through load_gpt)


def test_load_model_takes_the_command_line_spellings_for_random_bundles_too():
    import arsparse

    with pytest.raises(ValueError, match="unknown device 'gpu': use cpu, cuda or cuda:N"):
        arsparse.load_model("random-small", device="gpu")
    gpt, tok = arsparse.load_model("random-small", dtype="bf16")
    assert gpt.dtype == torch.bfloat16
