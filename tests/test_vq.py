"""Tests for the LlamaGen-compatible VQ model and the tokenizer interface."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from arsparse.models.vq import VQ_PRESETS, VQConfig, VQModel, vq_config
from arsparse.tokenizers import ImageTokenizer, PaletteTokenizer, VQTokenizer, save_grid, to_pil

DATA = Path(__file__).parent / "data"


def tiny_vq(seed=0, **kw) -> VQModel:
    """VQ-8 layout at ch=32 with a small codebook: shape checks stay fast."""
    torch.manual_seed(seed)
    args = dict(ch=32, z_channels=32, codebook_size=512)
    args.update(kw)
    return VQModel(vq_config("VQ-8", **args)).eval()


def fill_deterministic_(model):
    """Per-key deterministic weights; the same rule generated llamagen_vq_reference.json."""
    with torch.no_grad():
        for i, (k, v) in enumerate(sorted(model.state_dict().items())):
            g = torch.Generator().manual_seed(1000 + i)
            if k.endswith("codebook_used"):
                v.zero_()
            elif v.dim() > 1:
                v.copy_(torch.randn(v.shape, generator=g) * v[0].numel() ** -0.5)
            elif "norm" in k and k.endswith("weight"):
                v.copy_(1 + 0.1 * torch.randn(v.shape, generator=g))
            else:
                v.copy_(0.05 * torch.randn(v.shape, generator=g))


@pytest.fixture(scope="module")
def vq():
    return tiny_vq()


@pytest.fixture(scope="module")
def images():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)).clamp(-1, 1)


# --------------------------------------------------------------------------- key layout


@pytest.mark.parametrize("preset,fixture", [("VQ-16", "llamagen_keys_vq16.json"), ("VQ-8", "llamagen_keys_vq8.json")])
def test_state_dict_layout_matches_llamagen(preset, fixture):
    expected = json.loads((DATA / fixture).read_text())
    with torch.device("meta"):
        model = VQModel(vq_config(preset))
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert sorted(set(expected) - set(got)) == []
    assert sorted(set(got) - set(expected)) == []
    bad = {k: (expected[k], got[k]) for k in expected if expected[k] != got[k]}
    assert bad == {}
    assert got["quantize.codebook_used"] == [65536]


@pytest.mark.parametrize("preset", ["VQ-8", "VQ-16"])
def test_numerics_match_llamagen_reference(preset):
    """Tokens and reconstruction equal LlamaGen's own output for the same weights."""
    ref = json.loads((DATA / "llamagen_vq_reference.json").read_text())[preset]
    model = VQModel(vq_config(preset)).eval()
    fill_deterministic_(model)
    size = ref["image_size"]
    x = torch.randn((2, 3, size, size), generator=torch.Generator().manual_seed(ref["input_seed"])).clamp(-1, 1)
    tokens = model.encode_indices(x)
    assert tokens.tolist() == ref["tokens"]
    grid = (size // model.downsample,) * 2
    with torch.no_grad():
        recon = model.decode_indices(tokens, grid)
    sub = recon[:, :, ::4, ::4].flatten()
    torch.testing.assert_close(sub, torch.tensor(ref["recon_sub"]), atol=2e-4, rtol=1e-4)


# --------------------------------------------------------------------------- config


def test_presets_and_downsample():
    assert vq_config("VQ-16").downsample == 16
    assert vq_config("VQ-8").downsample == 8
    assert vq_config("VQ-16") == VQConfig()
    assert set(VQ_PRESETS) == {"VQ-16", "VQ-8"}
    cfg = vq_config("VQ-16", ch_mult=[1, 2], ch=64)
    assert cfg.encoder_ch_mult == cfg.decoder_ch_mult == (1, 2) and cfg.downsample == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(ch=48), "multiple of 32"),
    (dict(ch=0), "ch must be a positive int"),
    (dict(codebook_size=-1), "codebook_size"),
    (dict(encoder_ch_mult=()), "encoder_ch_mult must not be empty"),
    (dict(encoder_ch_mult=(1, 0)), "positive ints"),
    (dict(encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2, 4)), "same length"),
    (dict(dropout=1.5), "dropout"),
    (dict(num_res_blocks=2.0), "num_res_blocks"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VQConfig(**kwargs)


def test_vq_config_rejects_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown VQ preset 'VQ-32'.*VQ-16"):
        vq_config("VQ-32")
    with pytest.raises(ValueError, match="unknown VQConfig field.*chanels"):
        vq_config("VQ-8", chanels=3)


# --------------------------------------------------------------------------- quantisation


def test_encode_decode_shapes_and_range(vq, images):
    tok = VQTokenizer(vq)
    assert (tok.vocab_size, tok.downsample, tok.channels) == (512, 8, 3)
    ids = tok.encode(images)
    assert ids.shape == (2, 16) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < 512
    out = tok.decode(ids, (4, 4))
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.float32
    assert float(out.min()) >= -1.0 and float(out.max()) <= 1.0
    # non-square grids keep raster order: 2x8 grid decodes to 16x64 pixels
    assert tok.decode(ids, (2, 8)).shape == (2, 3, 16, 64)
    assert tok.image_size((2, 8)) == (16, 64)
    assert tok.grid_size((16, 64)) == (2, 8)
    assert isinstance(tok, ImageTokenizer)


def test_encode_is_nearest_normalised_code(vq, images):
    with torch.no_grad():
        feats = vq.quant_conv(vq.encoder(images))  # (B, D, h, w)
    feats = feats.permute(0, 2, 3, 1).reshape(2, -1, feats.shape[1])  # (B, N, D)
    codes = vq.quantize.embedding.weight
    cos = F.normalize(feats, dim=-1) @ F.normalize(codes, dim=-1).T  # (B, N, K)
    expected = cos.argmax(-1)
    assert expected.unique().numel() > 1  # a non-trivial assignment
    assert torch.equal(vq.encode_indices(images), expected)


def test_decode_uses_normalised_codebook(vq):
    ids = torch.randint(0, 512, (1, 4), generator=torch.Generator().manual_seed(5))
    codes = F.normalize(vq.quantize.embedding.weight, dim=-1)[ids[0]]  # (4, D)
    z = codes.T.reshape(1, -1, 2, 2)
    with torch.no_grad():
        expected = vq.decoder(vq.post_quant_conv(z))
        torch.testing.assert_close(vq.decode_indices(ids, (2, 2)), expected)


def test_roundtrip_is_deterministic(vq, images):
    tok = VQTokenizer(vq)
    a = tok.decode(tok.encode(images), (4, 4))
    b = tok.decode(tok.encode(images), (4, 4))
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])


def test_attention_block_matches_explicit_softmax():
    from arsparse.models.vq import AttnBlock

    torch.manual_seed(0)
    blk = AttnBlock(32).eval()
    x = torch.randn(2, 32, 3, 5)
    with torch.no_grad():
        y = blk.norm(x)
        q, k, v = (m(y).flatten(2) for m in (blk.q, blk.k, blk.v))  # (B, C, HW)
        w = torch.softmax(q.transpose(1, 2) @ k / 32 ** 0.5, dim=-1)  # (B, HWq, HWk)
        expected = x + blk.proj_out((v @ w.transpose(1, 2)).reshape(2, 32, 3, 5))
        torch.testing.assert_close(blk(x), expected, atol=1e-5, rtol=1e-5)


def test_training_forward_losses_and_straight_through():
    model = tiny_vq(seed=1).train()
    x = torch.randn(2, 3, 16, 16)
    recon, losses = model(x)
    assert recon.shape == x.shape
    assert set(losses) == {"codebook", "commit", "usage"}
    torch.testing.assert_close(losses["commit"], 0.25 * losses["codebook"])
    assert 0 < float(losses["usage"]) <= 1
    (recon.square().mean() + losses["codebook"] + losses["commit"]).backward()
    assert model.encoder.conv_in.weight.grad.abs().sum() > 0  # gradient crossed the quantiser
    assert model.quantize.embedding.weight.grad.abs().sum() > 0
    used = model.quantize.codebook_used[-8:]  # 2 images x 2x2 tokens
    assert torch.equal(used.long(), model.eval().encode_indices(x).flatten())
    _, eval_losses = model.eval()(x)
    assert eval_losses == {}


# --------------------------------------------------------------------------- input validation


def test_bad_inputs_raise_helpful_errors(vq, images):
    tok = VQTokenizer(vq)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        tok.encode(images[0])
    with pytest.raises(ValueError, match="3 channels"):
        tok.encode(torch.randn(1, 4, 32, 32))
    with pytest.raises(ValueError, match="multiple of .*8"):
        tok.encode(torch.randn(1, 3, 30, 32))
    with pytest.raises(ValueError, match="floats"):
        tok.encode(torch.randint(0, 255, (1, 3, 32, 32)))
    ids = torch.randint(0, 512, (2, 16))
    with pytest.raises(ValueError, match=r"\[0, 512\).*512"):
        tok.decode(torch.full((1, 4), 512), (2, 2))
    with pytest.raises(ValueError, match=r"\[0, 512\).*-1"):
        tok.decode(torch.full((1, 4), -1), (2, 2))
    with pytest.raises(ValueError, match="3x5 = 15 tokens.*N=16"):
        tok.decode(ids, (3, 5))
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        tok.decode(ids[0], (4, 4))
    with pytest.raises(ValueError, match="integer"):
        tok.decode(ids.float(), (4, 4))
    with pytest.raises(ValueError, match="grid"):
        tok.decode(ids, (4, 0))
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        vq.decode_indices(torch.full((1, 4), 600), (2, 2))
    with pytest.raises(ValueError, match="does not match"):
        vq.decode_indices(ids, (2, 2))
    with pytest.raises(ValueError, match="20x32 must be a multiple of .*factor 8"):
        tok.grid_size((20, 32))
    with pytest.raises(ValueError, match="VQModel"):
        VQTokenizer(torch.nn.Linear(2, 2))


def test_decode_without_the_range_check_gives_the_same_images(vq):
    """check_range=False (the engine's own tokens: no wait for the device) skips only the range check."""
    tok = VQTokenizer(vq)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(tok.decode(ids, (4, 4), check_range=False), tok.decode(ids, (4, 4)))
    assert torch.equal(vq.decode_indices(ids, (4, 4), check_range=False), vq.decode_indices(ids, (4, 4)))
    with pytest.raises(ValueError, match="3x5"):  # the other checks stay
        tok.decode(ids, (3, 5), check_range=False)


# --------------------------------------------------------------------------- PIL helpers


def test_to_pil_and_save_grid(tmp_path):
    x = torch.rand(5, 3, 8, 12) * 2 - 1
    x[0, :, 0, 0] = torch.tensor([-1.0, 1.0, 3.0])  # exact ends and an out-of-range value
    pics = to_pil(x)
    assert len(pics) == 5 and pics[0].size == (12, 8) and pics[0].mode == "RGB"
    assert pics[0].getpixel((0, 0)) == (0, 255, 255)
    px = pics[2].getpixel((5, 3))
    assert px == tuple(int(round((float(v) + 1) * 127.5)) for v in x[2, :, 3, 5])
    assert to_pil(torch.rand(1, 1, 4, 4) * 2 - 1)[0].mode == "L"

    grid = save_grid(x, tmp_path / "sub" / "grid.png", nrow=2, padding=1)
    assert grid.size == (2 * 13 + 1, 3 * 9 + 1)
    back = Image.open(tmp_path / "sub" / "grid.png")
    assert back.size == grid.size
    assert back.getpixel((1 + 13 + 5, 1 + 3)) == pics[1].getpixel((5, 3))
    with pytest.raises(ValueError, match="nrow"):
        save_grid(x, tmp_path / "g.png", nrow=0)
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        to_pil(torch.rand(3, 8, 8))


@pytest.mark.parametrize("make", [lambda: VQTokenizer(tiny_vq()), lambda: PaletteTokenizer(48)])
def test_encode_refuses_non_finite_and_out_of_range_pixels(make):
    """NaN pixels became token -2**63 (palette) or a code (VQ), values past [-1, 1] were clamped or encoded:
    now a ValueError naming [-1, 1]; float rounding just past it is still taken."""
    tok = make()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for bad, msg in [(float("nan"), "finite floats in \\[-1, 1\\], got NaN pixels"),
                     (float("inf"), "finite floats in \\[-1, 1\\], got infinite pixels"),
                     (-float("inf"), "got infinite pixels"),
                     (1.5, "floats in \\[-1, 1\\] .*got range \\[.*, 1.5\\]"),
                     (-2.0, "floats in \\[-1, 1\\] .*got range \\[-2, ")]:
        y = x.clone()
        y[1, 2, 3, 4] = bad  # (the last channel: the palette's grey is the mean of all three)
        with pytest.raises(ValueError, match=msg):
            tok.encode(y)
    y = x.clone()
    y[0, 0, 0, :2] = torch.tensor([1 + 1e-6, -1 - 1e-6])
    assert tok.encode(y).shape[0] == 2
    if isinstance(tok, PaletteTokenizer):  # grey input too
        g = y[:, :1].clone()
        assert tok.encode(g)[0, :2].tolist() == [47, 0]
        g[1, 0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN pixels"):
            tok.encode(g)


def test_empty_batches_decode_to_empty_images(vq):
    """(0, N) tokens -> (0, 3, H, W) images, as the palette tokenizer (and both encoders) already gave;
    the VQ path raised torch's reshape (or min of an empty tensor) error."""
    tok, empty = VQTokenizer(vq), torch.zeros(0, 16, dtype=torch.long)
    for check_range in (True, False):
        assert tok.decode(empty, (4, 4), check_range=check_range).shape == (0, 3, 32, 32)
        assert vq.decode_indices(empty, (4, 4), check_range=check_range).shape == (0, 3, 32, 32)
    assert PaletteTokenizer(48).decode(empty, (4, 4)).shape == (0, 3, 4, 4)
    assert tok.encode(torch.zeros(0, 3, 32, 32)).shape == (0, 16)
    with pytest.raises(ValueError, match="3x5 = 15 tokens"):  # the other checks stay
        tok.decode(empty, (3, 5))
