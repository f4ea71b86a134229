"""Fashion-MNIST loading (from the Debian package's files) and the palette tokenizer."""
import gzip
import struct

import numpy as np
import pytest
import torch

from arsparse.data import FASHION_CLASSES, FashionDataError, fetch_fashion, find_fashion_dir, load_fashion, read_idx
from arsparse.tokenizers import ImageTokenizer, PaletteTokenizer, VQTokenizer

try:
    FASHION_DIR = find_fashion_dir()
except FashionDataError:
    FASHION_DIR = None
needs_fashion = pytest.mark.skipif(
    FASHION_DIR is None,
    reason="Fashion-MNIST is not installed: `apt-get install dataset-fashion-mnist` (CI installs it)")


@pytest.fixture(scope="module")
def train_split():
    return load_fashion("train")


# ---- the real data ------------------------------------------------------------------------------

@needs_fashion
def test_train_split_shapes_and_labels(train_split):
    images, labels = train_split
    assert images.shape == (60000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (60000,) and labels.dtype == torch.int64
    assert int(labels.min()) == 0 and int(labels.max()) == 9
    assert torch.bincount(labels, minlength=10).tolist() == [6000] * 10  # Fashion-MNIST is balanced
    assert int(images.min()) == 0 and int(images.max()) == 255
    # about half the pixels are background (exact 0), the rest is garment
    assert 0.3 < (images == 0).float().mean().item() < 0.7


@needs_fashion
def test_test_split_shapes_and_labels():
    images, labels = load_fashion("test")
    assert images.shape == (10000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (10000,) and labels.dtype == torch.int64
    assert torch.bincount(labels, minlength=10).tolist() == [1000] * 10


@needs_fashion
def test_classes_are_told_apart_by_their_pixels(train_split):
    """The labels match the images: trousers are tall and narrow, bags are wide."""
    images, labels = train_split
    ink = (images > 0).float()
    width = ink.amax(dim=1).sum(-1)  # (N,) columns with any ink
    assert FASHION_CLASSES[1] == "Trouser" and FASHION_CLASSES[8] == "Bag"
    assert width[labels == 1].mean() < width[labels == 8].mean() - 5


def test_class_names():
    assert len(FASHION_CLASSES) == 10
    assert FASHION_CLASSES[0] == "T-shirt/top" and FASHION_CLASSES[9] == "Ankle boot"


def test_bad_split():
    with pytest.raises(ValueError, match="split"):
        load_fashion("validation")


# ---- finding and parsing files ------------------------------------------------------------------

def _idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    return bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def _write_fake_dataset(d, n_train=6, n_test=4, gz=True, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    data = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        imgs = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labs = rng.integers(0, 10, (n,), dtype=np.uint8)
        for kind, arr in (("images-idx3-ubyte", imgs), ("labels-idx1-ubyte", labs)):
            raw = _idx_bytes(arr)
            name = f"{prefix}-{kind}" + (".gz" if gz else "")
            (d / name).write_bytes(gzip.compress(raw) if gz else raw)
        data[prefix] = (imgs, labs)
    return data


@pytest.mark.parametrize("gz", [True, False])
def test_load_from_root_gz_or_plain(tmp_path, gz):
    data = _write_fake_dataset(tmp_path / "fm", gz=gz)
    images, labels = load_fashion("train", root=tmp_path / "fm")
    assert np.array_equal(images.numpy(), data["train"][0])
    assert np.array_equal(labels.numpy(), data["train"][1].astype(np.int64))
    images, labels = load_fashion("test", root=tmp_path / "fm")
    assert images.shape == (4, 28, 28) and labels.dtype == torch.int64


def test_arsparse_data_env_is_searched_first(tmp_path, monkeypatch):
    _write_fake_dataset(tmp_path / "fashion-mnist", n_train=3)
    monkeypatch.setenv("ARSPARSE_DATA", str(tmp_path))
    assert find_fashion_dir() == tmp_path / "fashion-mnist"
    assert load_fashion("train")[0].shape == (3, 28, 28)


def test_missing_dir_says_how_to_install(tmp_path):
    with pytest.raises(FashionDataError, match="apt-get install dataset-fashion-mnist"):
        find_fashion_dir(tmp_path / "nowhere")
    # an explicit root is never installed into
    with pytest.raises(FashionDataError, match="not installing"):
        fetch_fashion(tmp_path / "nowhere")


def test_missing_everywhere(tmp_path, monkeypatch):
    import arsparse.data.fashion as fm

    monkeypatch.setenv("ARSPARSE_DATA", str(tmp_path))
    monkeypatch.setattr(fm, "FASHION_SYSTEM_DIR", tmp_path / "no-system-copy")
    with pytest.raises(FashionDataError) as err:
        find_fashion_dir()
    assert "ARSPARSE_DATA" in str(err.value) and "apt-get install" in str(err.value)


@needs_fashion
def test_fetch_returns_the_installed_dir():
    assert fetch_fashion() == FASHION_DIR


def test_corrupt_files_are_reported(tmp_path):
    d = tmp_path / "fm"
    _write_fake_dataset(d)
    bad_magic = d / "train-labels-idx1-ubyte.gz"
    bad_magic.write_bytes(gzip.compress(b"\x12\x34\x08\x01" + b"\x00" * 20))
    with pytest.raises(FashionDataError, match="magic"):
        load_fashion("train", root=d)
    truncated = d / "t10k-images-idx3-ubyte.gz"
    truncated.write_bytes(gzip.compress(_idx_bytes(np.zeros((4, 28, 28), np.uint8))[:-10]))
    with pytest.raises(FashionDataError, match="truncated"):
        load_fashion("test", root=d)
    broken_gzip = d / "train-images-idx3-ubyte.gz"
    noise = np.random.default_rng(0).integers(0, 256, (6, 28, 28), dtype=np.uint8)
    whole = gzip.compress(_idx_bytes(noise))
    broken_gzip.write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(FashionDataError, match="cannot read"):
        read_idx(broken_gzip)


def test_read_idx_other_types(tmp_path):
    arr = np.arange(12, dtype=">i4").reshape(3, 4)
    p = tmp_path / "x.idx"
    p.write_bytes(_idx_bytes(arr, code=0x0C))
    out = read_idx(p)
    assert out.dtype == np.int32 and np.array_equal(out, arr)


def test_labels_out_of_range(tmp_path):
    d = tmp_path / "fm"
    _write_fake_dataset(d)
    (d / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(np.full(6, 12, np.uint8))))
    with pytest.raises(FashionDataError, match="out of range"):
        load_fashion("train", root=d)


# ---- the palette tokenizer ----------------------------------------------------------------------

def _to_unit(u8: torch.Tensor) -> torch.Tensor:
    return u8.float() / 127.5 - 1.0


def test_palette_256_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    u8 = torch.randint(0, 256, (5, 1, 12, 20), generator=g, dtype=torch.uint8)
    tok = PaletteTokenizer(256)
    ids = tok.encode(_to_unit(u8))
    assert ids.shape == (5, 240) and ids.dtype == torch.int64
    assert torch.equal(ids, u8.flatten(1).long())  # the token is the byte
    out = tok.decode(ids, (12, 20))
    assert out.shape == (5, 3, 12, 20)
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 2])  # grey in 3 channels
    assert torch.equal(((out[:, :1] + 1) * 127.5).round().to(torch.uint8), u8)


@pytest.mark.parametrize("levels", [16, 32, 64])
def test_palette_quantisation_matches_the_formula(levels):
    g = torch.Generator().manual_seed(levels)
    u8 = torch.randint(0, 256, (4, 1, 9, 8), generator=g, dtype=torch.uint8)
    u8.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte value appears
    tok = PaletteTokenizer(levels)
    want = np.round(u8.numpy().astype(np.float64) * (levels - 1) / 255).astype(np.int64).reshape(4, -1)
    ids = tok.encode(_to_unit(u8))
    assert np.array_equal(ids.numpy(), want)
    assert torch.equal(tok.bytes_to_tokens(u8).flatten(1), ids)  # the fast path used by the trainer
    assert int(ids.max()) == levels - 1 and int(ids.min()) == 0
    # decoding lands on the nearest representable grey: error at most half a step
    back = ((tok.decode(ids, (9, 8))[:, :1] + 1) * 127.5).round()
    assert (back - u8.float()).abs().max() <= 255 / (levels - 1) / 2 + 0.5
    # and re-encoding a decoded image gives the same tokens
    assert torch.equal(tok.encode(tok.decode(ids, (9, 8))), ids)


def test_palette_rgb_is_turned_grey():
    g = torch.Generator().manual_seed(1)
    grey = torch.randint(0, 256, (2, 1, 4, 4), generator=g, dtype=torch.uint8)
    rgb = _to_unit(grey).expand(-1, 3, -1, -1)
    tok = PaletteTokenizer(256)
    assert torch.equal(tok.encode(rgb), tok.encode(_to_unit(grey)))
    mixed = torch.stack([torch.full((4, 4), -1.0), torch.full((4, 4), 1.0), torch.full((4, 4), 0.0)])[None]
    assert tok.encode(mixed).unique().tolist() == [round(127.5)]  # mean 0 -> byte 127.5 -> 128


def test_palette_interface():
    tok = PaletteTokenizer(32)
    assert isinstance(tok, ImageTokenizer)
    assert (tok.vocab_size, tok.downsample, tok.channels) == (32, 1, 1)
    assert tok.grid_size((28, 28)) == (28, 28) and tok.image_size((28, 28)) == (28, 28)
    assert tok.to("cpu") is tok
    cfg = tok.config()
    assert cfg == {"type": "palette", "levels": 32}
    assert PaletteTokenizer.from_config(cfg).levels == 32
    with pytest.raises(ValueError):
        PaletteTokenizer.from_config({"type": "vq"})
    for bad in (1, 257, 3.0, True):
        with pytest.raises(ValueError, match="levels"):
            PaletteTokenizer(bad)
    with pytest.raises(ValueError, match="token ids"):
        tok.decode(torch.full((1, 4), 32), (2, 2))
    with pytest.raises(ValueError, match="channels"):
        tok.encode(torch.zeros(1, 2, 4, 4))


def test_vq_tokenizer_to_moves_the_model():
    from arsparse.models.vq import VQModel, vq_config

    vq = VQTokenizer(VQModel(vq_config("VQ-8", ch=32, z_channels=32, codebook_size=64)))
    assert vq.to("cpu") is vq and vq.device == torch.device("cpu")
    vq.model.to(torch.float64)
    assert vq.to("cpu").dtype == torch.float64  # to(device) keeps the dtype
