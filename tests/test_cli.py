import json
import os

import pytest
import torch
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


def test_bad_input_gives_a_message_not_a_traceback(tmp_path, capsys, monkeypatch):
    assert main(["generate", "--model", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["generate", "--classes", "1,5000", "--out", str(tmp_path)]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["generate", "--gpt-ckpt", str(tmp_path / "missing.pt"), "--vq-ckpt", "x.pt", "--out", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--policies", "dense"]) == 2
        assert "needs a CUDA device, and none is available here" in capsys.readouterr().err
    assert main(["bench", "--ring-launch", "num_warps=3"]) == 2
    assert "num_warps=3 is invalid" in capsys.readouterr().err
    assert main(["bench", "--variant", "ring.rows_per_program=2", "--variant", "warps=2"]) == 2
    assert "unknown variant setting 'warps=2'" in capsys.readouterr().err
    assert main(["generate", "--model", "random-small", "--matvec", "--compile", "--out", str(tmp_path)]) == 2
    assert "matvec=True takes neither compile" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the CPU takes the matvec kernels in the interpreter)
    assert main(["generate", "--model", "random-small", "--matvec", "--num-images", "9", "--out", str(tmp_path)]) == 2
    assert "takes batches of at most 8 images with guidance; got 9" in capsys.readouterr().err


def test_bad_values_fail_before_any_work_with_a_message(tmp_path, capsys):
    for argv, msg in [(["generate", "--num-images", "0"], "expected a positive integer, got '0'"),
                      (["generate", "--nrow", "0"], "expected a positive integer, got '0'"),
                      (["generate", "--cfg-scale", "nan"], "expected a finite number, got 'nan'"),
                      (["eval", "--temperature", "inf"], "expected a finite number, got 'inf'"),
                      (["serve", "--port", "99999"], "expected a TCP port 0..65535, got '99999'")]:
        with pytest.raises(SystemExit) as e:  # (argparse: usage and the message, status 2)
            main(argv + ["--out", str(tmp_path)] if argv[0] != "serve" else argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    afile = tmp_path / "afile"
    afile.write_text("")
    (tmp_path / "garbage.safetensors").write_bytes(torch.randint(0, 256, (500,), dtype=torch.uint8).numpy().tobytes())
    for argv, msg in [
        (["generate", "--model", "random-small", "--caption-features", str(afile)], "for text-conditional (t2i) models"),
        (["generate", "--model", "random-small", "--device", "bogus"], "unknown device 'bogus'"),
        (["generate", "--model", "random-small", "--num-images", "1", "--out", str(afile / "x")], "Not a directory"),
        (["analyze", "--rho", "0.25,2", "--out", str(tmp_path)], "--rho: [2.0] out of range"),
        (["bench", "--batch", "8,0"], "--batch sizes must be >= 1"),
        (["bench", "--layers", "0"], "--layers must be >= 1"),
        (["train", "classifier", "--out", str(tmp_path / "c.txt")], "must end in .safetensors"),
        (["train", "classifier", "--out", str(afile / "c.safetensors")], "is a file, not a folder"),
        (["convert", str(afile), str(tmp_path / "o.safetensors")], "unknown checkpoint extension"),
        (["train", "classifier", "--out", "/proc/c.safetensors"], "does not take new files"),
        (["train", "classifier", "--out", str(tmp_path / "c.safetensors"), "--device", "bogus"], "unknown device 'bogus'"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("arsparse: error:") and msg in err, (argv, err)
    # (eval may first warn that the held-out data is not installed)
    assert main(["eval", "--classifier", str(tmp_path / "garbage.safetensors"), "--out", str(tmp_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("arsparse: error:") and "garbage.safetensors: not a readable safetensors file" in last
    (tmp_path / "garbage.pt").write_bytes(b"not a pickle at all")
    assert main(["convert", str(tmp_path / "garbage.pt"), str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint torch.load(weights_only=True) can read" in err and len(err.splitlines()) == 1


def test_models_and_convert(tmp_path, capsys):
    assert main(["models", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert "random-small" in {b["name"] for b in listing["bundles"]}
    import torch

    torch.save({"model": {"w": torch.randn(3, 4)}}, tmp_path / "a.pt")
    assert main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "a.safetensors")]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "a.safetensors"))["w"].shape == (3, 4)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # (not mkstemp's 0600)


def test_policies_listing(capsys):
    import arsparse.policies as policies

    assert main(["policies", "--json", "--model", "random-small"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["name"] for r in rows} == set(policies.names())
    dense = next(r for r in rows if r["name"] == "dense")
    assert dense["kept"] == 1 + 255 and dense["rho"] == 1.0


def _tiny_checkpoints(tmp_path):
    """A tiny GPT (4x4 tokens, vocab 48) and a matching tiny VQ-16, saved as LlamaGen-layout files."""
    from arsparse.checkpoint import save_safetensors
    from arsparse.loading import config_metadata
    from arsparse.models.vq import VQModel, vq_config
    from conftest import random_gpt

    gpt = random_gpt("c2i", image_tokens=16)
    save_safetensors(gpt.state_dict(), tmp_path / "gpt.safetensors", config_metadata(gpt.config))
    vq = VQModel(vq_config("VQ-16", ch=32, codebook_size=48))
    save_safetensors(vq.state_dict(), tmp_path / "vq.safetensors", config_metadata(vq.config))
    return ["--gpt-ckpt", str(tmp_path / "gpt.safetensors"), "--vq-ckpt", str(tmp_path / "vq.safetensors")]


def test_every_policy_runs_end_to_end_through_generate(tmp_path, capsys):
    import arsparse.policies as policies

    ckpt = _tiny_checkpoints(tmp_path)
    for name in policies.names():
        args = {"diagonal": ["--policy-arg", "local=2", "--policy-arg", "rows=1", "--policy-arg", "band=1"],
                "streaming": ["--policy-arg", "recent=5"],
                "adsa": ["--policy-arg", "rho=0.9", "--policy-arg", "local=4"],
                "diagonal-adaptive": ["--policy-arg", "rho=0.9", "--policy-arg", "calib_rows=2"]}.get(name, ["--policy-arg", "rho=0.9"])
        if name == "dense":
            args = []
        out = tmp_path / name
        rc = main(["generate", *ckpt, "--classes", "3,4", "--cfg-scale", "2", "--out", str(out), "--quiet",
                   "--policy", name, *args])
        assert rc == 0, capsys.readouterr().err
        assert json.loads((out / "generate.json").read_text())["policy"]["name"] == name
        assert len(list((out / "images").glob("*.png"))) == 2
    assert main(["generate", *ckpt, "--policy", "diagonal", "--policy-arg", "band=-1", "--out", str(tmp_path)]) == 2
    assert "band must be an integer >= 0" in capsys.readouterr().err
    from arsparse.checkpoint import save_safetensors
    from arsparse.loading import config_metadata
    from arsparse.models.vq import VQModel, vq_config

    vq = VQModel(vq_config("VQ-16", ch=32, codebook_size=64))  # (the GPT predicts 48 ids)
    save_safetensors(vq.state_dict(), tmp_path / "vq64.safetensors", config_metadata(vq.config))
    assert main(["generate", ckpt[0], ckpt[1], "--vq-ckpt", str(tmp_path / "vq64.safetensors"), "--out", str(tmp_path)]) == 2
    assert "has 64 codes but --gpt-ckpt" in capsys.readouterr().err


def test_generate_from_a_trained_file_takes_the_tokenizer_it_names(tmp_path, capsys):
    """A file arsparse trained names its tokenizer (fashion's: a palette), so --gpt-ckpt alone generates,
    with the same images as the bundle of that file."""
    from arsparse.bundles import WEIGHTS_DIR

    path = WEIGHTS_DIR / "fashion-c2i.safetensors"  # (shipped in the package: tests/test_shipped.py)
    seed = str(int(torch.randint(0, 1000, ())))
    common = ["--classes", "7", "--seed", seed, "--cfg-scale", "2", "--device", "cpu", "--quiet"]
    assert main(["generate", "--gpt-ckpt", str(path), *common, "--out", str(tmp_path / "a")]) == 0, capsys.readouterr().err
    assert main(["generate", "--model", "fashion-c2i", *common, "--out", str(tmp_path / "b")]) == 0
    a, b = (sorted((tmp_path / d / "images").glob("*.png")) for d in "ab")
    assert len(a) == 1 and Image.open(a[0]).size == Image.open(b[0]).size == (28, 28)
    assert Image.open(a[0]).tobytes() == Image.open(b[0]).tobytes()
