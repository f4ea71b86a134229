import json

from PIL import Image

from arsparse.cli import main


def test_generate_writes_pngs_of_the_requested_size(tmp_path):
    out = tmp_path / "out"
    rc = main(["generate", "--model", "random-small", "--classes", "3,5", "--num-images", "3", "--seed", "1",
               "--out", str(out), "--quiet", "--top-k", "100"])
    assert rc == 0
    files = sorted((out / "images").glob("*.png"))
    assert [f.name for f in files] == ["0000_class3.png", "0001_class5.png", "0002_class3.png"]
    for f in files:
        with Image.open(f) as im:
            im.verify()
        with Image.open(f) as im:
            assert im.size == (256, 256) and im.mode == "RGB"
    with Image.open(out / "grid.png") as grid:
        assert grid.size == (3 * 258 + 2, 258 + 2)
    assert json.loads((out / "generate.json").read_text())["num_images"] == 3


def test_bad_input_gives_a_message_not_a_traceback(tmp_path, capsys):
    assert main(["generate", "--model", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["generate", "--classes", "1,5000", "--out", str(tmp_path)]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["generate", "--gpt-ckpt", str(tmp_path / "missing.pt"), "--vq-ckpt", "x.pt", "--out", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


def test_models_and_convert(tmp_path, capsys):
    assert main(["models", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert "random-small" in {b["name"] for b in listing["bundles"]}
    import torch

    torch.save({"model": {"w": torch.randn(3, 4)}}, tmp_path / "a.pt")
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "a.safetensors")]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "a.safetensors"))["w"].shape == (3, 4)
