"""The emoji-c2i path end to end at tiny scale on a real slice of the data: VQ, tokens, GPT, export, bundle, eval."""
import hashlib
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

import arsparse
from arsparse import bundles
from arsparse.data import emoji as E
from arsparse.loading import TOKENIZER_META, read_metadata


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """$ARSPARSE_DATA with an emoji/ folder holding 48 training and 8 held-out real emoji."""
    try:
        real = E.load_emoji_table()
    except E.EmojiDataError as e:
        pytest.skip(f"emoji npm data not fetched: {e} (CI runs `arsparse data fetch emoji`)")
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.choice(np.flatnonzero(~real.test), 48, replace=False),
                          rng.choice(np.flatnonzero(real.test), 8, replace=False)])
    root = tmp_path_factory.mktemp("data")
    E.save_emoji_table(real.subset(np.sort(idx)), root / "emoji")
    return root


def test_missing_bundle_weights_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setattr(bundles, "WEIGHTS_DIR", tmp_path)
    assert not bundles.BUNDLES["emoji-c2i"].available
    with pytest.raises(ValueError, match="emoji-c2i.safetensors, emoji-vq.safetensors missing.*emoji-train.sh"):
        arsparse.load_model("emoji-c2i")


def test_emoji_vq_gpt_export_bundle_and_eval(tmp_path, data_root, monkeypatch, capsys):
    from arsparse.cli import main as arsparse_main
    from arsparse.training.cli import main

    monkeypatch.setenv("ARSPARSE_DATA", str(data_root))
    common = ["--device", "cpu", "--quiet", "--resume", "--warmup", "1"]
    vq = ["tokenizer", "--dataset", "emoji", "--out", str(tmp_path / "vq"), "--ch", "32", "--codebook-size", "64",
          "--steps", "2", "--batch-size", "8", "--eval-samples", "4", *common]
    assert main(vq + ["--stop-after", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
    assert main(vq) == 0
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done["finished"] and done["vq"].endswith("emoji-vq.safetensors")

    gpt_cmd = ["model", "--dataset", "emoji", "--vq", done["vq"], "--preset", "GPT-tiny", "--steps", "2",
               "--batch-size", "4", "--eval-samples", "4", "--out", str(tmp_path / "gpt"), *common]
    assert main(gpt_cmd) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["finished"]
    tok_cfg = json.loads(read_metadata(out["model"])[TOKENIZER_META])
    assert tok_cfg["type"] == "vq" and tok_cfg["file"] == "emoji-vq.safetensors"
    assert tok_cfg["sha256"] == hashlib.sha256(open(done["vq"], "rb").read()).hexdigest()
    g = arsparse.load_gpt(out["model"]).config
    assert (g.grid_h, g.grid_w, g.vocab_size, g.num_classes) == (32, 32, 64, 18)
    # tokens were cached beside the data: the training split has the 48 images plus mirrors
    cached = torch.load(next((data_root / "emoji").glob("tokens-train-*.pt")), weights_only=True)
    n_flip = int((~torch.isin(cached["labels"][:48] % 9, torch.tensor([7, 8]))).sum())
    assert cached["tokens"].shape == (48 + n_flip, 1024)

    ship = tmp_path / "ship"
    assert main(["export", "--gpt-dir", str(tmp_path / "gpt"), "--vq-dir", str(tmp_path / "vq"), "--out", str(ship),
                 "--cfg-scales", "3", "--rows", "1", "--device", "cpu", "--quiet",
                 "--command", "arsparse train tokenizer --dataset emoji"]) == 0
    card = (ship / "emoji-c2i.md").read_text()
    for f in ("emoji-c2i.safetensors", "emoji-vq.safetensors"):
        want = re.search(rf"`{re.escape(f)}`[^`]*sha256 `([0-9a-f]{{64}})`", card).group(1)
        assert hashlib.sha256((ship / f).read_bytes()).hexdigest() == want
    assert "CC-BY" in card and "Apache" in card and "arsparse train tokenizer --dataset emoji" in card
    grid = Image.open(ship / "emoji-c2i-samples.png")
    assert grid.size[0] > 18 * 64 and grid.size[1] >= 64

    monkeypatch.setattr(bundles, "WEIGHTS_DIR", ship)
    gpt, tok = arsparse.load_model("emoji-c2i")
    assert tok.downsample == 2 and tok.vocab_size == 64
    assert arsparse_main(["eval", "--model", "emoji-c2i", "--policies", "dense,diagonal", "--num-samples", "4",
                          "--nll-images", "4", "--batch-size", "4", "--nll-batch", "4", "--grid-images", "4",
                          "--no-mobilenet", "--device", "cpu", "--quiet", "--out", str(tmp_path / "eval")]) == 0
    res = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert res["model"] == "emoji-c2i" and "emoji held-out split (8 images" in res["nll_data"]
    assert [r["policy"] for r in res["rows"]] == ["dense", "diagonal"]
    assert all(r["nll_bits_per_token"] is not None for r in res["rows"])
