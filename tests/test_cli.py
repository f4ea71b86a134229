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


def test_generate_samples_a_policy_at_its_bundles_calibrated_guidance(tmp_path, capsys):
    """fashion-c2i carries a guidance for diagonal at its default settings: generate uses it unless
    --cfg-scale is given (the same images as that scale given) or the policy's settings change."""
    from arsparse.bundles import BUNDLES

    b = BUNDLES["fashion-c2i"]
    calibrated = dict(b.policy_cfg_scales)["diagonal"]
    common = ["--model", "fashion-c2i", "--classes", "4", "--seed", str(int(torch.randint(0, 1000, ()))),
              "--device", "cpu", "--quiet"]
    runs = {"a": ["--policy", "diagonal"], "b": ["--policy", "diagonal", "--cfg-scale", str(calibrated)],
            "c": ["--policy", "diagonal:rows=2"], "d": ["--policy", "dense"]}
    for d, extra in runs.items():
        assert main(["generate", *common, *extra, "--out", str(tmp_path / d)]) == 0, capsys.readouterr().err
    got = {d: json.loads((tmp_path / d / "generate.json").read_text())["cfg_scale"] for d in runs}
    assert got == dict(a=calibrated, b=calibrated, c=b.cfg_scale, d=b.cfg_scale) and calibrated != b.cfg_scale
    pixels = [Image.open(tmp_path / d / "images" / "0000_class4.png").tobytes() for d in "ab"]
    assert pixels[0] == pixels[1]


def test_generate_replaces_the_images_of_an_earlier_run_in_the_same_folder(tmp_path, capsys):
    """A reused --out holds this run's images only (an earlier run made more), and files generate
    did not write are left alone."""
    ckpt = _tiny_checkpoints(tmp_path)
    out = tmp_path / "out"
    assert main(["generate", *ckpt, "--classes", "1,2,3", "--num-images", "5", "--out", str(out), "--quiet"]) == 0
    (out / "images" / "mine.png").write_bytes(b"x")
    (out / "images" / "0001_class1.txt").write_text("notes")
    assert main(["generate", *ckpt, "--classes", "4", "--num-images", "2", "--out", str(out), "--quiet"]) == 0
    assert sorted(f.name for f in (out / "images").iterdir()) == ["0000_class4.png", "0001_class1.txt",
                                                                  "0001_class4.png", "mine.png"]
    assert json.loads((out / "generate.json").read_text())["num_images"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "earlier images (images/NNNN_classK.png, NNNN_captionK.png) replaced by this run's" in help_text


def test_empty_int_lists_are_refused_not_taken_as_the_default(tmp_path, capsys, monkeypatch):
    import arsparse.analysis.cli as analysis_cli
    import arsparse.cli as cli

    for mod in (cli, analysis_cli):
        monkeypatch.setattr(mod, "build_model", lambda *a, **k: pytest.fail("the work started"))
    for argv in (["generate", "--classes", ","], ["generate", "--classes", " , "], ["analyze", "--layers", ","],
                 ["analyze", "--heads", ""]):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--out", str(tmp_path / "never")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "expected one or more comma-separated integers like 1,2,3, got" in err, argv
    assert not (tmp_path / "never").exists()


def test_generate_takes_the_policy_spelling_of_eval_and_bench(tmp_path, capsys):
    """--policy NAME:KEY=VALUE,... as eval's --policies and bench's take it (the same parser): its settings
    apply, they win over --policy-arg, and a bad one is a message."""
    ckpt = _tiny_checkpoints(tmp_path)
    common = [*ckpt, "--classes", "3", "--seed", "4", "--cfg-scale", "2", "--quiet"]
    assert main(["generate", *common, "--policy", "diagonal:local=2,rows=1,band=1", "--out", str(tmp_path / "a")]) == 0
    assert main(["generate", *common, "--policy", "diagonal", "--policy-arg", "local=2", "--policy-arg", "rows=1",
                 "--policy-arg", "band=1", "--out", str(tmp_path / "b")]) == 0
    assert main(["generate", *common, "--policy", "diagonal:rows=1,band=1", "--policy-arg", "local=2",
                 "--policy-arg", "rows=3", "--out", str(tmp_path / "c")]) == 0, capsys.readouterr().err
    a, b, c = (json.loads((tmp_path / d / "generate.json").read_text())["policy"] for d in "abc")
    assert a == b == c and a["name"] == "diagonal"
    pixels = [Image.open(tmp_path / d / "images" / "0000_class3.png").tobytes() for d in "abc"]
    assert pixels[0] == pixels[1] == pixels[2]
    assert main(["generate", *common, "--policy", "diagonal:band=-1", "--out", str(tmp_path / "d")]) == 2
    assert "band must be an integer >= 0" in capsys.readouterr().err
    assert main(["generate", *common, "--policy", "diagonal:rows", "--out", str(tmp_path / "d")]) == 2
    assert "policy argument 'rows' must look like key=value" in capsys.readouterr().err


def test_missing_plots_extra_is_refused_before_analyze_or_a_sweep_starts(tmp_path, capsys, monkeypatch):
    import sys

    import arsparse.analysis.cli as analysis_cli
    import arsparse.bundles as bundles

    def no_work(*a, **k):
        raise AssertionError("the work started")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib fails, as when not installed)
    monkeypatch.setattr(analysis_cli, "build_model", no_work)
    monkeypatch.setattr(bundles, "load_model", no_work)
    assert main(["analyze", "--model", "fashion-c2i", "--out", str(tmp_path / "an")]) == 2
    assert capsys.readouterr().err == ("arsparse: error: analyze draws figures and needs the plots extra (matplotlib "
                                       "is missing): pip install 'arsparse[plots]'\n")
    assert main(["eval", "--model", "fashion-c2i", "--sweep-rho", "0.5", "--out", str(tmp_path / "sw")]) == 2
    assert capsys.readouterr().err == ("arsparse: error: --sweep-rho draws sweep.png and needs the plots extra "
                                       "(matplotlib is missing): pip install 'arsparse[plots]'\n")
    assert not (tmp_path / "an").exists() and not (tmp_path / "sw").exists()


def test_analyze_checks_its_output_folder_before_the_work(tmp_path, capsys, monkeypatch):
    import arsparse.analysis.cli as analysis_cli

    monkeypatch.setattr(analysis_cli, "build_model", lambda *a, **k: pytest.fail("the work started"))
    afile = tmp_path / "afile"
    afile.write_text("")
    for out, msg in (("/proc/x", "cannot write /proc/x/stats.json: /proc does not take new files"),
                     (str(afile / "x"), f"cannot write {afile}/x/stats.json: {afile} is a file, not a folder")):
        assert main(["analyze", "--model", "fashion-c2i", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("arsparse: error: ") and msg in err and len(err.splitlines()) == 1, err


def test_serve_bench_refuses_more_images_per_request_than_the_server_takes(capsys, monkeypatch):
    import arsparse.serve.cli as serve_cli

    monkeypatch.setattr(serve_cli, "_app_from_args", lambda *a, **k: pytest.fail("the server was built"))
    for n, extra, limit, fix in ((9, [], 8, "raise --max-images"), (5, ["--max-batch", "4"], 4, "raise --max-batch"),
                                 (9, ["--max-images", "2", "--max-batch", "3"], 2, "raise --max-images and --max-batch")):
        assert main(["serve-bench", "--model", "fashion-c2i", "--n", str(n), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"arsparse: error: --n {n} is more images per request than the server takes: at most "
                              f"{limit} (--max-images") and err.rstrip().endswith(f"lower --n or {fix}"), err


def test_serve_bench_json_has_null_not_nan_when_every_request_fails():
    pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'arsparse[serve]'")
    from arsparse.serve.loadgen import serve_bench
    from serve_util import make_app, tiny_model

    gpt, tok = tiny_model(seed=21)
    app = make_app(gpt, tok, max_batch=2, max_images=1)
    out = serve_bench(app, "tiny", requests=2, concurrency=1, n=2, warmup=0, num_classes=7, client_process=False)
    assert out["failures"] == 2 and out["failure_statuses"] == [422] and out["requests_per_s"] == 0
    for k in ("latency_p50_s", "latency_p90_s", "latency_p99_s", "latency_mean_s"):
        assert out[k] is None, k
    text = json.dumps(out, allow_nan=False)  # (raises on NaN or Infinity)
    assert "NaN" not in text and json.loads(text)["latency_p50_s"] is None


def test_bench_checks_its_flags_and_output_before_the_timing(tmp_path, capsys):
    """(On a machine without CUDA these must come before bench's own CUDA check, as --batch's do.)"""
    (tmp_path / "b.png").write_text("")
    for argv, msg in [
        (["--kernels", "triton,foo"], "--kernels takes torch or triton, comma-separated; got 'triton,foo'"),
        (["--llamagen-src", str(tmp_path / "none")], "has no autoregressive/models/gpt.py"),
        (["--out", str(tmp_path / "b.png")], "the output must end in .json"),
        (["--out", "/proc/b.json"], "does not take new files"),
        (["--batch", "max", "--memory-gb", "0"], "--memory-gb must be > 0, got 0.0"),
        (["--batch", "8", "--memory-gb", "4"], "--memory-gb sets the budget of --batch max"),
    ]:
        assert main(["bench"] + argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("arsparse: error:") and msg in err, (argv, err)
    for argv in (["--cfg-scale", "nan"], ["--memory-gb", "nan"]):
        with pytest.raises(SystemExit) as e:
            main(["bench"] + argv)
        assert e.value.code == 2 and "expected a finite number, got 'nan'" in capsys.readouterr().err
