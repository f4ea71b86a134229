"""Emoji data: the npm packages' index, alpha compositing, the held-out split, the .npz cache."""
import json

import numpy as np
import pytest
from PIL import Image

from arsparse.data import emoji as E

CACHE = E.emoji_cache_dir()
HAVE_PNGS = all((CACHE / s / "FETCHED").is_file() for s in E.EMOJI_STYLES)
needs_pngs = pytest.mark.skipif(
    not HAVE_PNGS, reason=f"emoji npm data not fetched into {CACHE}: run `arsparse data fetch emoji` (CI does)")


def reference_composite(im: Image.Image) -> np.ndarray:
    """PIL's own alpha compositing over opaque white (independent of composite_on_white)."""
    rgba = im.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def fake_meta():
    return [
        dict(unified="1F600", image="1f600.png", category="Smileys & Emotion", subcategory="face-smiling",
             sort_order=1, has_img_google=True, has_img_twitter=False),
        dict(unified="1F44B", image="1f44b.png", category="People & Body", subcategory="hand-fingers-open",
             sort_order=2, has_img_google=True, has_img_twitter=True,
             skin_variations={"1F3FC": dict(unified="1F44B-1F3FC", image="1f44b-1f3fc.png", has_img_google=True,
                                             has_img_twitter=True),
                              "1F3FB": dict(unified="1F44B-1F3FB", image="1f44b-1f3fb.png", has_img_google=False,
                                            has_img_twitter=True)}),
        dict(unified="1F3FB", image="1f3fb.png", category="Component", subcategory="skin-tone", sort_order=3,
             has_img_google=True, has_img_twitter=True),
    ]


def test_entries_keep_variants_drop_component_and_label_style_major():
    g = E.emoji_entries(fake_meta(), "google")
    t = E.emoji_entries(fake_meta(), "twitter")
    assert [r["code"] for r in g] == ["1F600", "1F44B", "1F44B-1F3FC"]
    assert [r["code"] for r in t] == ["1F44B", "1F44B-1F3FB", "1F44B-1F3FC"]
    assert [r["label"] for r in g] == [0, 1, 1]
    assert all(r["label"] == len(E.EMOJI_CATEGORIES) + 1 for r in t)  # People & Body / twitter
    assert E.EMOJI_CLASSES[t[0]["label"]] == "People & Body/twitter"
    assert {r["base"] for r in g[1:] + t} == {"1F44B"}
    with pytest.raises(ValueError, match="style"):
        E.emoji_entries(fake_meta(), "apple")


def test_class_names():
    assert len(E.EMOJI_CLASSES) == 18 and E.EMOJI_CLASSES[0] == "Smileys & Emotion/google"
    assert E.EMOJI_CLASSES[17] == "Flags/twitter" and not any("Component" in c for c in E.EMOJI_CLASSES)


def test_composite_matches_pil_on_random_rgba():
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    a = rng.integers(0, 256, (16, 16, 4), dtype=np.uint8)
    im = Image.fromarray(a, "RGBA")
    assert np.abs(E.composite_on_white(im).astype(int) - reference_composite(im).astype(int)).max() <= 1
    la = Image.fromarray(a[..., :2].copy(), "LA")  # grey + alpha
    assert np.abs(E.composite_on_white(la).astype(int) - reference_composite(la).astype(int)).max() <= 1


def test_held_out_is_a_pure_function_of_the_base_code_at_about_ten_percent():
    codes = [f"{c:X}" for c in range(0x1F300, 0x1F300 + 4000)]
    frac = np.mean([E.is_held_out(c) for c in codes])
    assert 0.08 < frac < 0.12
    assert all(E.is_held_out(c) == E.is_held_out(c.lower()) for c in codes[:50])


def write_fake_cache(root, rng):
    """Two styles of fake_meta() with random RGBA PNGs, marked as fetched."""
    for style in E.EMOJI_STYLES:
        d = root / style
        (d / "64").mkdir(parents=True)
        (d / "emoji.json").write_text(json.dumps(fake_meta()))
        for r in E.emoji_entries(fake_meta(), style):
            Image.fromarray(rng.integers(0, 256, (64, 64, 4), dtype=np.uint8), "RGBA").save(d / "64" / r["image"])
        (d / "FETCHED").write_text(E._versions()[style] + "\n")


def test_npz_cache_is_written_and_then_enough_alone(tmp_path):
    rng = np.random.default_rng(0)
    write_fake_cache(tmp_path, rng)
    data = E.load_emoji_table(tmp_path)
    assert data.images.shape == (6, 64, 64, 3) and data.images.dtype == np.uint8
    first = Image.open(tmp_path / "google" / "64" / "1f600.png")
    assert np.abs(data.images[0].astype(int) - reference_composite(first).astype(int)).max() <= 1
    assert (tmp_path / E.NPZ_NAME).is_file()
    for style in E.EMOJI_STYLES:  # the .npz alone is enough
        import shutil

        shutil.rmtree(tmp_path / style)
    again = E.load_emoji_table(tmp_path)
    np.testing.assert_array_equal(again.images, data.images)
    np.testing.assert_array_equal(again.labels, data.labels)
    x, y = again.split("all")
    assert x.shape == (6, 64, 64, 3) and y.tolist() == data.labels.tolist()
    with pytest.raises(ValueError, match="split"):
        again.split("val")


def test_missing_data_and_missing_npm_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(E.EmojiDataError, match="arsparse data fetch emoji"):
        E.load_emoji_table(tmp_path / "nothing")
    monkeypatch.setattr(E.shutil, "which", lambda name: None)
    with pytest.raises(E.EmojiDataError, match="npm is not installed"):
        E.fetch_emoji(tmp_path / "nothing", quiet=True)


def test_cache_dir_follows_arsparse_data(monkeypatch, tmp_path):
    monkeypatch.setenv("ARSPARSE_DATA", str(tmp_path))
    assert E.emoji_cache_dir() == tmp_path / "emoji"
    assert E.emoji_cache_dir(tmp_path / "x") == tmp_path / "x"


# ---- the real packages -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    if not HAVE_PNGS:
        pytest.skip(f"emoji npm data not fetched into {CACHE}: run `arsparse data fetch emoji` (CI does)")
    return E.load_emoji_table()


@needs_pngs
def test_real_index_counts_and_split(real):
    meta = json.loads((CACHE / "google" / "emoji.json").read_text())
    assert len(real.labels) == sum(len(E.emoji_entries(meta, s)) for s in E.EMOJI_STYLES)
    assert len(real.labels) > 7000
    counts = np.bincount(real.labels, minlength=18)
    assert (counts > 50).all()
    # the same emoji is held out in both styles, with every skin-tone variant
    for base in np.unique(real.base):
        m = real.base == base
        assert real.test[m].all() or not real.test[m].any()
    assert set(real.base[real.test]).isdisjoint(real.base[~real.test])
    assert 0.07 < real.test.mean() < 0.14
    i = {(c, int(l)) for c, l in zip(real.codes, real.labels)}
    assert ("1F600", 0) in i and ("1F600", 9) in i  # grinning face: Smileys & Emotion in both styles


@needs_pngs
def test_real_images_equal_their_pngs_composited_on_white(real):
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    for k in rng.choice(len(real.labels), 12, replace=False):
        style = E.EMOJI_STYLES[real.labels[k] // len(E.EMOJI_CATEGORIES)]
        meta = {r["code"]: r for r in E.emoji_entries(json.loads((CACHE / style / "emoji.json").read_text()), style)}
        ref = reference_composite(Image.open(CACHE / style / "64" / meta[str(real.codes[k])]["image"]))
        assert np.abs(real.images[k].astype(int) - ref.astype(int)).max() <= 1
    # white background: the corners of most emoji are white
    assert (real.images[:, 0, 0] == 255).all(-1).mean() > 0.7


@needs_pngs
def test_real_styles_differ_and_splits_partition(real):
    x_tr, y_tr = real.split("train")
    x_te, y_te = real.split("test")
    assert len(x_tr) + len(x_te) == len(real.labels)
    g = real.images[real.labels == 0].astype(float).mean(0)
    t = real.images[real.labels == 9].astype(float).mean(0)
    assert np.abs(g - t).mean() > 2.0  # Google and Twitter smileys look different on average


def test_fetch_extracts_only_the_index_and_64px_pngs(tmp_path, monkeypatch):
    """`npm pack` is replaced by a fake that writes a package tarball with extra files."""
    import io
    import subprocess
    import tarfile

    rng = np.random.default_rng(1)
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        spec, dest = cmd[2], cmd[cmd.index("--pack-destination") + 1]
        style = next(s for s in E.EMOJI_STYLES if spec == E._versions()[s])
        with tarfile.open(f"{dest}/pkg.tgz", "w:gz") as tar:
            def add(name, data):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            add("package/emoji.json", json.dumps(fake_meta()).encode())
            add(f"package/img/{style}/sheets/64.png", b"sheet")
            add(f"package/img/{style}/32/1f600.png", b"small")
            for r in E.emoji_entries(fake_meta(), style):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (64, 64, 4), dtype=np.uint8), "RGBA").save(buf, "PNG")
                add(f"package/img/{style}/64/{r['image']}", buf.getvalue())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(E.shutil, "which", lambda name: "/usr/bin/npm")
    monkeypatch.setattr(E.subprocess, "run", fake_run)
    d = E.fetch_emoji(tmp_path, quiet=True)
    assert [c[2] for c in calls] == [E._versions()[s] for s in E.EMOJI_STYLES]
    for style in E.EMOJI_STYLES:
        files = sorted(p.relative_to(d / style).as_posix() for p in (d / style).rglob("*") if p.is_file())
        want = sorted(["FETCHED", "emoji.json"] + [f"64/{r['image']}" for r in E.emoji_entries(fake_meta(), style)])
        assert files == want
    E.fetch_emoji(tmp_path, quiet=True)  # already there: npm is not called again
    assert len(calls) == 2
    assert len(E.load_emoji_table(tmp_path).labels) == 6
