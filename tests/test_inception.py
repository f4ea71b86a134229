"""Inception-v3 for the standard FID (arsparse.eval.inception): torchvision's key layout and size, the
TensorFlow graph's pools, loading either public checkpoint, and the FID column of the eval."""
import json

import pytest
import torch
import torch.nn.functional as F

from arsparse.checkpoint import CheckpointError
from arsparse.eval.inception import InceptionFeatures, InceptionV3, load_inception

#: torchvision's inception_v3 (with its auxiliary head), as its model card states.
TORCHVISION_PARAMS = 27_161_264


def _aux_head_params(classes: int = 1000) -> int:
    """torchvision's InceptionAux: 1x1 conv 768 -> 128 + BN, 5x5 conv 128 -> 768 + BN, fc 768 -> classes."""
    return 768 * 128 + 2 * 128 + 128 * 768 * 25 + 2 * 768 + 768 * classes + classes


def test_network_has_torchvisions_layout_and_size():
    net = InceptionV3(num_classes=1000, tf_pools=False)
    assert sum(p.numel() for p in net.parameters()) == TORCHVISION_PARAMS - _aux_head_params()
    sd = InceptionV3().state_dict()  # (the FID graph: 1008 classes)
    want = {"Conv2d_1a_3x3.conv.weight": (32, 3, 3, 3), "Conv2d_4a_3x3.bn.running_var": (192,),
            "Mixed_5b.branch_pool.conv.weight": (32, 192, 1, 1), "Mixed_5d.branch5x5_2.conv.weight": (64, 48, 5, 5),
            "Mixed_6a.branch3x3.conv.weight": (384, 288, 3, 3), "Mixed_6b.branch7x7_2.conv.weight": (128, 128, 1, 7),
            "Mixed_6e.branch7x7dbl_5.conv.weight": (192, 192, 1, 7), "Mixed_7a.branch7x7x3_4.conv.weight": (192, 192, 3, 3),
            "Mixed_7b.branch_pool.conv.weight": (192, 1280, 1, 1), "Mixed_7c.branch3x3dbl_3b.conv.weight": (384, 384, 3, 1),
            "fc.weight": (1008, 2048), "fc.bias": (1008,)}
    for k, shape in want.items():
        assert tuple(sd[k].shape) == shape, k
    assert not any(k.startswith("AuxLogits") for k in sd)
    assert all(m.eps == 1e-3 for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_tensorflow_pools_leave_the_padding_out_and_the_last_block_max_pools():
    """On a constant image the TF graph's 3x3 average is the constant everywhere; torchvision's counts
    the zero padding (4/9 in a corner, 6/9 on an edge). Mixed_7c of the FID graph takes the maximum of
    each 3x3 neighbourhood (checked against a direct loop), Mixed_7b the mean."""
    tf, tv = InceptionV3(), InceptionV3(1000, tf_pools=False)
    ones = torch.ones(1, 288, 5, 5)
    assert torch.equal(tf.Mixed_5d.pool(ones), ones)
    corner, edge = tv.Mixed_5d.pool(ones)[0, 0, 0, 0].item(), tv.Mixed_5d.pool(ones)[0, 0, 0, 2].item()
    assert corner == pytest.approx(4 / 9) and edge == pytest.approx(6 / 9)
    x = torch.randn(1, 2, 4, 5, generator=torch.Generator().manual_seed(1))
    want = torch.empty_like(x)
    for i in range(4):
        for j in range(5):
            want[..., i, j] = x[..., max(i - 1, 0): i + 2, max(j - 1, 0): j + 2].amax(dim=(-1, -2))
    assert torch.equal(tf.Mixed_7c.pool(x), want)
    assert torch.allclose(tf.Mixed_7b.pool(x)[..., 1, 1], x[..., :3, :3].mean(dim=(-1, -2)))
    assert not torch.equal(tv.Mixed_7c.pool(x), want)


def test_features_of_grey_images_at_299_px():
    """[-1, 1] grey 28 px images -> the network's pool features of the RGB copy resized bilinearly to 299."""
    torch.manual_seed(0)
    net = InceptionV3().eval()
    feats = InceptionFeatures(net)
    images = torch.rand(2, 1, 28, 28) * 2 - 1
    got = feats(images)
    x = F.interpolate(images.expand(-1, 3, -1, -1), size=(299, 299), mode="bilinear", align_corners=False)
    with torch.no_grad():
        torch.testing.assert_close(got, net.pooled(x))
    assert got.shape == (2, 2048) and torch.isfinite(got).all() and feats.standard_fid


def test_load_picks_the_network_from_the_checkpoint_and_rejects_bad_files(tmp_path):
    torch.manual_seed(1)
    fid = InceptionV3()
    torch.save(fid.state_dict(), tmp_path / "pt_inception.pth")
    net = load_inception(tmp_path / "pt_inception.pth")
    assert net.tf_pools and InceptionFeatures(net).standard_fid
    x = torch.rand(1, 3, 80, 80) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(net.pooled(x), fid.eval().pooled(x))
    # torchvision's file: 1000 classes, an auxiliary head (dropped), no BN batch counts (an older format)
    tv = {k: v for k, v in InceptionV3(1000, tf_pools=False).state_dict().items() if "num_batches" not in k}
    tv.update({"AuxLogits.fc.weight": torch.zeros(1000, 768), "AuxLogits.conv0.conv.weight": torch.zeros(128, 768, 1, 1)})
    torch.save(tv, tmp_path / "inception_v3_google.pth")
    net = load_inception(tmp_path / "inception_v3_google.pth")
    assert not net.tf_pools and not InceptionFeatures(net).standard_fid
    bad = dict(fid.state_dict())
    bad["Mixed_6c.branch7x7_9.conv.weight"] = bad.pop("Mixed_6c.branch7x7_2.conv.weight")
    torch.save({"state_dict": bad}, tmp_path / "renamed.pth")
    with pytest.raises(CheckpointError, match=r"Mixed_6c\.branch7x7_2\.conv\.weight"):
        load_inception(tmp_path / "renamed.pth")
    torch.save({"fc.weight": torch.zeros(10, 2048)}, tmp_path / "tiny.pth")
    with pytest.raises(ValueError, match=r"fc.weight of shape \(1008 or 1000, 2048\), got \(10, 2048\)"):
        load_inception(tmp_path / "tiny.pth")
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(ValueError, match="cannot be read as a PyTorch checkpoint"):
        load_inception(tmp_path / "notes.txt")
    with pytest.raises(FileNotFoundError, match="pt_inception-2015-12-05"):
        load_inception(tmp_path / "missing.pth")


def test_eval_reports_fid_when_given_inception_weights(tmp_path, capsys, monkeypatch):
    """`arsparse eval --inception PATH`: a FID per policy (the dense row's own delta 0), the weights
    named in the JSON and the report; without weights the column is empty and a note says how to
    fill it; a wrong path is a message."""
    import arsparse.bundles as bundles
    from arsparse.cli import main
    from arsparse.tokenizers import PaletteTokenizer
    from conftest import random_gpt

    gpt = random_gpt(image_tokens=16, seed=3)
    monkeypatch.setattr(bundles, "load_model", lambda name: (gpt, PaletteTokenizer(48)))
    torch.manual_seed(2)
    torch.save(InceptionV3().state_dict(), tmp_path / "pt_inception.pth")
    args = ["eval", "--model", "random-small", "--policies", "dense,streaming", "--num-samples", "6",
            "--nll-images", "2", "--batch-size", "6", "--grid-images", "4", "--no-mobilenet", "--quiet",
            "--policy-arg", "streaming:rho=0.5"]
    assert main([*args, "--inception", str(tmp_path / "pt_inception.pth"), "--out", str(tmp_path / "a")]) == 0
    saved = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert saved["fid_weights"].startswith("pytorch-fid")
    assert all(r["fid"] is not None and r["fid"] >= 0 for r in saved["rows"])
    assert saved["rows"][0]["fid_delta_pct"] == 0.0 and saved["rows"][1]["fid_delta_pct"] is not None
    assert "| FID |" in (tmp_path / "a" / "eval.md").read_text()
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    saved = json.loads((tmp_path / "b" / "eval.json").read_text())
    assert all(r["fid"] is None for r in saved["rows"]) and saved["fid_weights"] is None
    assert any("--inception PATH" in n for n in saved["notes"])
    capsys.readouterr()
    assert main([*args, "--inception", str(tmp_path / "nope.pth"), "--out", str(tmp_path / "c")]) == 2
    assert "Inception weights not found" in capsys.readouterr().err
