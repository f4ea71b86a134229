"""The HTTP API on a tiny model: round trip, every kind of bad input, the OpenAPI fuzz, the page, the CLI."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'arsparse[serve]'")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from conftest import random_gpt  # noqa: E402
from serve_util import DIAGONAL_4x4, b64_pixels, make_app, offline_pixels, offline_tokens, png_pixels, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served():
    gpt, tok = tiny_model()
    app = make_app(gpt, tok)
    with TestClient(app) as client:
        yield gpt, tok, app, client
    app.state.pool.close()


@pytest.mark.parametrize("body", [
    dict(class_label=3, n=2, seed=5),
    dict(class_label=6, n=3, seed=2**53 - 1, cfg_scale=1.0, temperature=0.7, top_k=5, top_p=0.9),  # the largest
    dict(class_label=0, n=1, seed=11, cfg_scale=4.0, cfg_interval=2, policy="diagonal", policy_args=DIAGONAL_4x4),
])
def test_round_trip_gives_the_offline_tokens_and_images(served, body):
    gpt, tok, _, client = served
    r = client.post("/v1/generate", json=dict(body, return_tokens=True))
    assert r.status_code == 200, r.text
    data = r.json()
    want = offline_tokens(gpt, body)
    assert torch.equal(torch.tensor(data["tokens"]), want)
    assert data["seed"] == body["seed"] and data["n"] == body["n"] and len(data["images"]) == body["n"]
    assert data["policy"]["mode"] == "continuous" and data["policy"]["name"] == body.get("policy", "dense")
    for got, ref in zip(data["images"], offline_pixels(tok, gpt, want)):
        assert np.array_equal(b64_pixels(got), ref)
    assert r.headers["x-request-id"] == data["id"] and data["timing"]["total_s"] > 0


def test_png_answer_is_a_grid_of_the_same_images(served):
    gpt, tok, _, client = served
    body = dict(class_label=2, n=3, seed=9)
    r = client.post("/v1/generate", json=body, headers={"Accept": "image/png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    grid = png_pixels(r.content)
    tiles = offline_pixels(tok, gpt, offline_tokens(gpt, body))
    assert grid.shape == (4 + 2 * 2, 3 * (4 + 2) + 2, 3)  # 3 tiles of 4x4 px, 2 px padding
    for i, tile in enumerate(tiles):
        assert np.array_equal(grid[2:6, 2 + 6 * i : 6 + 6 * i], tile)
    assert r.headers["x-seed"] == "9"


def test_seed_is_random_when_omitted_and_reported(served):
    gpt, _, _, client = served
    a = client.post("/v1/generate", json=dict(class_label=1, return_tokens=True)).json()
    b = client.post("/v1/generate", json=dict(class_label=1, return_tokens=True)).json()
    assert a["seed"] != b["seed"]
    assert torch.equal(torch.tensor(a["tokens"]), offline_tokens(gpt, dict(class_label=1, seed=a["seed"])))


def test_info_endpoints(served):
    gpt, _, _, client = served
    models = client.get("/v1/models").json()["models"]
    assert models[0]["name"] == "tiny" and models[0]["num_classes"] == gpt.config.num_classes
    assert models[0]["image_tokens"] == 16 and models[0]["max_images"] == 4 and models[0]["guidance"]
    pols = client.get("/v1/policies").json()
    from arsparse import policies

    assert {p["name"] for p in pols["policies"]} == set(policies.names()) and pols["default"] == "dense"
    modes = {p["name"]: p["mode"] for p in pols["policies"]}
    assert modes["dense"] == modes["diagonal"] == modes["streaming"] == "continuous" and modes["h2o"] == "cohort"
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["policies"][0]["slots"] == 8
    page = client.get("/")
    assert page.status_code == 200 and "<form" in page.text


def test_metrics_are_prometheus_text(served):
    _, _, _, client = served
    client.post("/v1/generate", json=dict(class_label=1, seed=1))
    text = client.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("arsparse_queue_length", "arsparse_running_images", "arsparse_tokens_per_second",
                 "arsparse_kv_bytes_in_use", "arsparse_kv_bytes_capacity", "arsparse_request_latency_seconds",
                 "arsparse_tokens", "arsparse_max_running_images"):
        assert name in fams, name
    count = [s.value for s in fams["arsparse_request_latency_seconds"].samples
             if s.name.endswith("_count") and s.labels["policy"] == "dense"]
    assert count and count[0] >= 1
    tokens = [s.value for s in fams["arsparse_tokens"].samples if s.labels["policy"] == "dense"]
    assert tokens[0] >= 16
    cap = [s.value for s in fams["arsparse_kv_bytes_capacity"].samples if s.labels["policy"] == "dense"][0]
    cfg = served[0].config
    assert cap == 8 * 2 * 2 * cfg.n_layer * cfg.kv_heads * cfg.seq_len * cfg.head_dim * 4  # slots x rows x K,V x fp32


BAD = [
    # (what, raw body or JSON, words the message must contain)
    ("malformed JSON", '{"class_label": 3,', ["not valid JSON", '"class_label"']),
    ("not an object", "[1, 2]", ["must be a JSON object"]),
    ("empty body", "", ["body is missing"]),
    ("deep nesting", '{"class_label": ' + "[" * 5000 + "]" * 5000 + "}", ["nests deeper than the JSON parser allows"]),
    ("missing class", {"n": 1}, ["class_label", "required"]),
    ("class as a string", {"class_label": "3"}, ["class_label", "valid integer", "'3'"]),
    ("class as a float", {"class_label": 3.5}, ["class_label", "integer"]),
    ("class as a bool", {"class_label": True}, ["class_label", "integer"]),
    ("class out of range", {"class_label": 7}, ["class_label", "less than or equal to 6", "got 7"]),
    ("negative class", {"class_label": -1}, ["class_label", "greater than or equal to 0"]),
    ("too many images", {"class_label": 1, "n": 5}, ["n:", "less than or equal to 4", "got 5"]),
    ("no images", {"class_label": 1, "n": 0}, ["n:", "greater than or equal to 1"]),
    ("negative seed", {"class_label": 1, "seed": -1}, ["seed", "greater than or equal to 0"]),
    ("seed past JSON's exact integers", {"class_label": 1, "seed": 2**53}, ["seed", "less than 9007199254740992"]),
    ("top_p zero", {"class_label": 1, "top_p": 0}, ["top_p", "greater than 0"]),
    ("temperature negative", {"class_label": 1, "temperature": -0.5}, ["temperature", "greater than or equal to 0"]),
    ("NaN", '{"class_label": 1, "cfg_scale": NaN}', ["cfg_scale", "finite"]),
    ("unknown field", {"class_label": 1, "sed": 3}, ["sed", "unknown field", "seed"]),
    ("unknown policy", {"class_label": 1, "policy": "fast"}, ["policy", "'dense'", "'diagonal'", "got 'fast'"]),
    ("unknown policy parameter", {"class_label": 1, "policy": "diagonal", "policy_args": {"width": 2}},
     ["diagonal", "unknown parameter", "width", "allowed", "band"]),
    ("bad policy parameter", {"class_label": 1, "policy": "streaming", "policy_args": {"recent": 0}},
     ["streaming", "recent must be an integer >= 1", "got 0"]),
    ("policy that does not fit the model", {"class_label": 1, "policy": "diagonal"},
     ["diagonal", "band=4", "row stride (4)"]),
    ("huge policy parameter", {"class_label": 1, "policy": "streaming", "policy_args": {"recent": 10**12}},
     ["recent", "out of range", "sequence length"]),
    ("policy_args not an object", {"class_label": 1, "policy_args": [1]}, ["policy_args", "dictionary"]),
    ("policy_args without policy", {"class_label": 1, "policy_args": {"bogus": 1}},
     ["policy_args ['bogus'] given without policy", "default is 'dense'"]),
]


@pytest.mark.parametrize("what,body,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx_saying_what_and_what_is_allowed(served, what, body, words):
    _, _, _, client = served
    if isinstance(body, str):
        r = client.post("/v1/generate", content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post("/v1/generate", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    for w in words:
        assert w in detail, f"{w!r} not in {detail!r}"


def test_a_wrong_path_or_method_names_what_the_server_answers(served):
    client = served[3]
    for r, status in ((client.get("/v1/generat"), 404), (client.get("/v1/generate"), 405)):
        assert r.status_code == status
        assert "this server answers POST /v1/generate" in r.json()["detail"], r.text


def test_a_body_too_large_gets_413_and_a_stalled_one_408():
    """Content-Length past the limit: refused before the body is read; a chunked body is counted as it
    comes; a body that stops short of its Content-Length times out instead of holding the connection."""
    import asyncio

    gpt, tok = tiny_model()
    app = make_app(gpt, tok, max_body_bytes=2000, body_timeout_s=0.3)
    try:
        with TestClient(app) as client:
            ok = dict(class_label=1, seed=2, policy_args=None, top_k=0)
            assert client.post("/v1/generate", json=ok).status_code == 200
            big = b'{"class_label": 1, "seed": 2' + b" " * 2000 + b"}"
            r = client.post("/v1/generate", content=big, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "is 2029 bytes; this server takes at most 2000" in r.json()["detail"]
            r = client.post("/v1/generate", content=iter([big[:1500], big[1500:]]),  # chunked: no Content-Length
                            headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "more than 2000 bytes" in r.json()["detail"], r.text

        async def stalled():
            sent, first = [], True

            async def receive():
                nonlocal first
                if first:
                    first = False
                    return dict(type="http.request", body=b'{"class_label": 1', more_body=True)
                await asyncio.sleep(3600)

            async def send(message):
                sent.append(message)

            scope = dict(type="http", asgi=dict(version="3.0"), http_version="1.1", method="POST", scheme="http",
                         path="/v1/generate", raw_path=b"/v1/generate", root_path="", query_string=b"",
                         headers=[(b"content-type", b"application/json"), (b"content-length", b"100")],
                         client=("127.0.0.1", 1), server=("127.0.0.1", 80))
            await asyncio.wait_for(app(scope, receive, send), 10)
            return sent

        t0 = time.monotonic()
        sent = asyncio.run(stalled())
        assert time.monotonic() - t0 < 5
        assert sent[0]["status"] == 408
        assert "stopped arriving: nothing for 0.3 s after 17 bytes" in sent[1]["body"].decode()
    finally:
        app.state.pool.close()
    with pytest.raises(ValueError, match="max_body_bytes must be a positive integer or None"):
        make_app(gpt, tok, max_body_bytes=0)


def test_malformed_http_gets_a_json_400_that_says_what_was_wrong():
    """Framing the app never sees (uvicorn answers it): a bad request line, a Content-Length that is not
    a number, a header without a colon. Each gets a 400 in JSON, as the API's own errors, and the server
    goes on answering."""
    from arsparse.serve.loadgen import ServerThread

    gpt, tok = tiny_model()
    with ServerThread(make_app(gpt, tok)) as srv:
        for raw, why in ((b"GARBAGE\r\n\r\n", "illegal request line"),
                         (b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", "content-length"),
                         (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", "header")):
            with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
                sock.sendall(raw)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), answer
            assert b"content-type: application/json" in head.lower(), head
            detail = json.loads(body)["detail"]
            assert detail.startswith("malformed HTTP request (") and why in detail.lower(), detail
            assert "POST /v1/generate" in detail
        assert httpx.get(srv.url + "/health").status_code == 200


def test_guidance_on_a_model_without_a_null_class_is_refused():
    from conftest import random_gpt

    from arsparse.tokenizers import PaletteTokenizer

    gpt = random_gpt("c2i", image_tokens=16, class_dropout_prob=0.0)
    with TestClient(make_app(gpt, PaletteTokenizer(48))) as client:
        r = client.post("/v1/generate", json=dict(class_label=1, cfg_scale=3.0))
        assert r.status_code == 422 and "cfg_scale" in r.json()["detail"] and "1" in r.json()["detail"]
        r = client.post("/v1/generate", json=dict(class_label=1, seed=3, return_tokens=True))
        assert r.status_code == 200
        assert torch.equal(torch.tensor(r.json()["tokens"]), offline_tokens(gpt, dict(class_label=1, seed=3), 1.0))


def test_caption_features_for_a_t2i_model():
    gpt, tok = tiny_model(model_type="t2i")
    P, C = gpt.config.cls_token_num, gpt.config.caption_dim
    feats = torch.randn(P, C, generator=torch.Generator().manual_seed(0))
    with TestClient(make_app(gpt, tok)) as client:
        r = client.post("/v1/generate", json=dict(caption_features=feats.tolist(), n=2, seed=4, return_tokens=True))
        assert r.status_code == 200, r.text
        from arsparse.engine.generator import Generator
        from arsparse import policies
        from arsparse.prompt_mask import pad_captions

        want = Generator(gpt, device="cpu").sample_tokens(feats[None].expand(2, P, C), cfg_scale=2.0, seed=4)
        assert torch.equal(torch.tensor(r.json()["tokens"]), want)
        # a shorter caption: left-padded and masked as LlamaGen's sampler, the offline generator's tokens
        short = feats[: P // 2]
        r = client.post("/v1/generate", json=dict(caption_features=short.tolist(), n=2, seed=5, return_tokens=True))
        assert r.status_code == 200, r.text
        padded, mask = pad_captions(short[None], None, P)
        want = Generator(gpt, device="cpu").sample_tokens(padded.expand(2, P, C), cfg_scale=2.0, seed=5,
                                                          prompt_mask=mask.expand(2, P))
        assert torch.equal(torch.tensor(r.json()["tokens"]), want)
        unmasked = Generator(gpt, device="cpu").sample_tokens(padded.expand(2, P, C), cfg_scale=2.0, seed=5)
        assert not torch.equal(want, unmasked)  # the mask mattered
        # and through a scored policy, served in cohorts by the fixed-batch engine
        r = client.post("/v1/generate", json=dict(caption_features=short.tolist(), n=2, seed=5, return_tokens=True,
                                                  policy="h2o", policy_args={"rho": 0.9}))
        assert r.status_code == 200, r.text
        want = Generator(gpt, device="cpu", policy=policies.get("h2o", rho=0.9)).sample_tokens(
            padded.expand(2, P, C), cfg_scale=2.0, seed=5, prompt_mask=mask.expand(2, P))
        assert torch.equal(torch.tensor(r.json()["tokens"]), want)
        r = client.post("/v1/generate", json=dict(caption_features=feats[:, :3].tolist()))
        assert r.status_code == 422 and "caption_features" in r.json()["detail"]
        r = client.post("/v1/generate", json=dict(caption_features=[]))
        assert r.status_code == 422 and "caption_features" in r.json()["detail"]
        r = client.post("/v1/generate", json=dict(class_label=1))
        assert r.status_code == 422 and "caption_features" in r.json()["detail"]


# ---- fuzzing against the OpenAPI schema -----------------------------------------------------------

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

OPERATIONS = [("POST", "/v1/generate"), ("GET", "/v1/models"), ("GET", "/v1/policies"), ("GET", "/health"),
              ("GET", "/metrics")]


@pytest.fixture(scope="module")
def fuzz_schema():
    gpt, tok = tiny_model()
    app = make_app(gpt, tok, max_policies=3, timeout_s=60.0)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    app.state.pool.close()


def test_every_operation_is_fuzzed(fuzz_schema):
    ops = {(r.ok().method.upper(), r.ok().path) for r in fuzz_schema.get_all_operations()}
    assert ops == set(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("method,path", OPERATIONS)
def test_fuzz_api_against_its_openapi_schema(fuzz_schema, method, path, mode):
    """No 5xx (but the 504 of a timeout_s too short to decode in), every answer (status, content type,
    headers, body) conforms to the schema, and data outside the schema is refused."""
    if mode is GenerationMode.NEGATIVE and method == "GET":
        pytest.skip("GET operations take no input")

    @given(case=fuzz_schema[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case):
        r = case.call_and_validate(excluded_checks=[positive_data_acceptance, not_a_server_error])
        if r.status_code >= 500:  # only the deadline a request set itself, when far too short to decode in
            timeout = case.body.get("timeout_s") if isinstance(case.body, dict) else None
            assert r.status_code == 504 and timeout is not None and timeout < 0.5, r.text
        if mode is GenerationMode.POSITIVE and r.status_code == 422:
            # What the schema cannot state: whether a policy's parameters fit this model.
            assert r.json()["detail"].startswith("policy: "), r.text

    check()


# ---- the web page in headless Chromium ------------------------------------------------------------

def _chromium():
    for browser in ("chromium", "chromium-browser"):
        path = shutil.which(browser)
        if path and shutil.which("chromedriver"):
            return path, shutil.which("chromedriver")
    return None


def test_the_page_draws_images_in_headless_chromium():
    found = _chromium()
    if found is None:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from arsparse.serve.loadgen import ServerThread

    gpt, tok = tiny_model()
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    with ServerThread(make_app(gpt, tok)) as srv:
        driver = webdriver.Chrome(service=Service(found[1]), options=opts)
        try:
            driver.get(srv.url + "/")
            wait = WebDriverWait(driver, 30)
            wait.until(lambda d: d.find_element(By.ID, "form").get_attribute("data-ready") == "1")
            Select(driver.find_element(By.ID, "class")).select_by_value("5")
            Select(driver.find_element(By.ID, "policy")).select_by_value("streaming")
            for field, value in (("seed", "42"), ("cfg", "3"), ("n", "2")):
                el = driver.find_element(By.ID, field)
                el.clear()
                el.send_keys(value)
            driver.find_element(By.ID, "go").click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#images img.result")) == 2)
            status = driver.find_element(By.ID, "status").text
            assert "2 image(s) in" in status and "streaming" in status and "continuous" in status
            srcs = [im.get_attribute("src") for im in driver.find_elements(By.CSS_SELECTOR, "#images img.result")]
            # The page shows what the API gives for the same choices.
            want = httpx.post(srv.url + "/v1/generate", json=dict(class_label=5, policy="streaming", seed=42,
                                                                   cfg_scale=3.0, n=2)).json()["images"]
            assert srcs == ["data:image/png;base64," + w for w in want]
            # A choice the server refuses (diagonal's default band does not fit a 4-wide grid) shows its message.
            Select(driver.find_element(By.ID, "policy")).select_by_value("diagonal")
            driver.find_element(By.ID, "go").click()
            wait.until(lambda d: "error 422" in d.find_element(By.ID, "status").text)
            assert "row stride" in driver.find_element(By.ID, "status").text
        finally:
            driver.quit()


# ---- arsparse serve ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_arsparse_serve_starts_and_answers_health():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "arsparse.cli", "serve", "--model", "fashion-c2i", "--policy",
                             "diagonal", "--port", str(port), "--max-batch", "4", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, health = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert health is not None, proc.stdout.read() if proc.poll() is not None else "no answer"
        assert health["status"] == "ok" and health["model"] == "fashion-c2i"
        assert health["policies"][0]["policy"] == "diagonal" and health["policies"][0]["slots"] == 4
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["models"][0]
        assert models["class_names"][0] == "T-shirt/top" and models["width"] == 28
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_arsparse_serve_rejects_a_bad_policy_before_loading(capsys):
    from arsparse.cli import main

    assert main(["serve", "--policy", "diagonal", "--policy-arg", "rows=-1"]) == 2
    assert "rows must be an integer >= 0" in capsys.readouterr().err
    # the NAME:key=value spelling of generate, eval and bench, its settings over --policy-arg's
    for cmd in ("serve", "serve-bench"):
        assert main([cmd, "--policy", "diagonal:rows=-1", "--policy-arg", "rows=2"]) == 2
        assert "rows must be an integer >= 0, got -1" in capsys.readouterr().err


def test_a_bad_default_guidance_fails_when_the_app_is_made():
    from arsparse.serve import create_app

    gpt, tok = tiny_model()
    for bad, msg in ((float("nan"), "cfg_scale must be a finite number"), (-3.0, "cfg_scale must be >= 0")):
        with pytest.raises(ValueError, match=msg):
            create_app(gpt, tok, cfg_scale=bad)


def test_serve_config_is_validated():
    from arsparse.serve import ServeConfig

    assert ServeConfig(compile=True).compile and not ServeConfig().compile
    for bad, msg in ((dict(compile="yes"), "compile must be True or False"), (dict(cuda_graphs=1), "cuda_graphs"),
                     (dict(max_queue=0), "max_queue must be a positive integer"),
                     (dict(max_images=9, max_batch=8), r"max_images \(9\) must be <= max_batch")):
        with pytest.raises(ValueError, match=msg):
            ServeConfig(**bad)


def test_image_decoder_precision_is_a_server_setting():
    """vq_dtype="bf16": the served images are what a bf16 copy of the VQ decodes from the offline tokens,
    a few levels from the fp32 decoder's (random weights: larger activations than a trained VQ's);
    the default follows the serving dtype; a bad value is refused."""
    import copy

    from arsparse.models.vq import VQModel, vq_config
    from arsparse.tokenizers import VQTokenizer

    torch.manual_seed(3)
    vq = VQTokenizer(VQModel(vq_config("VQ-8", ch=32, z_channels=32, codebook_size=64)))
    gpt = random_gpt("c2i", image_tokens=16, seed=4, vocab_size=64)
    body = dict(class_label=2, n=2, seed=9, return_tokens=True)
    served = copy.deepcopy(vq)
    with TestClient(make_app(gpt, served, vq_dtype="bf16")) as client:
        data = client.post("/v1/generate", json=body).json()
    assert served.dtype == torch.bfloat16
    tokens = torch.tensor(data["tokens"])
    assert torch.equal(tokens, offline_tokens(gpt, body))
    got = np.stack([b64_pixels(im).astype(int) for im in data["images"]])
    bf16 = copy.deepcopy(vq).to("cpu", torch.bfloat16)
    want = [offline_pixels(bf16, gpt, t[None])[0] for t in tokens]  # one at a time, as the CPU server decodes
    assert np.array_equal(got, np.stack(want))  # what a bf16 decoder gives
    diff = np.abs(got - np.stack(offline_pixels(vq, gpt, tokens)))  # against the fp32 decoder
    assert 0 < diff.max() <= 16 and diff.mean() < 2.0, (diff.max(), diff.mean())
    make_app(gpt, fp32 := copy.deepcopy(vq))
    assert fp32.dtype == torch.float32  # the serving dtype on the CPU
    with pytest.raises(ValueError, match="vq_dtype must be fp32, bf16, fp16 or None"):
        make_app(gpt, vq, vq_dtype="int8")


def test_a_policy_with_calibrated_guidance_gets_it_unless_the_request_asks_or_changes_its_settings():
    """create_app(policy_cfg_scales={policy: g}): a request under that policy at its default settings samples at
    g, one that changes the settings or gives cfg_scale at the server's scale or its own; /v1/models lists g."""
    from arsparse.serve import ServeConfig, create_app

    gpt, tok = tiny_model()
    # (fresh scales far from the server's 2: a random model's cond and uncond logits are close, so a small
    # change of guidance would often leave the tokens as they are)
    g_dense, g_diag = (round(float(x), 3) for x in 20 + 20 * torch.rand(2))
    app = create_app(gpt, tok, model_name="tiny", config=ServeConfig(max_batch=8, max_images=4, max_queue=64),
                     cfg_scale=2.0, policy_cfg_scales={"dense": g_dense, "diagonal": g_diag})
    try:
        with TestClient(app) as client:
            assert client.get("/v1/models").json()["models"][0]["policy_cfg_scales"] == {"dense": g_dense,
                                                                                       "diagonal": g_diag}
            for body, scale, other in ((dict(class_label=2, n=4, seed=7), g_dense, 2.0),
                                       (dict(class_label=4, n=4, seed=8, policy="dense", cfg_scale=3.0), 3.0, g_dense),
                                       (dict(class_label=5, n=4, seed=9, policy="diagonal", policy_args=DIAGONAL_4x4),
                                        2.0, g_diag)):
                r = client.post("/v1/generate", json=dict(body, return_tokens=True))
                assert r.status_code == 200, r.text
                want = offline_tokens(gpt, {**body, "cfg_scale": scale})
                assert not torch.equal(want, offline_tokens(gpt, {**body, "cfg_scale": other}))  # (tells them apart)
                assert torch.equal(torch.tensor(r.json()["tokens"]), want), (body, scale)
            r = client.post("/v1/generate", json=dict(class_label=1, policy="diagonal", policy_args={"wide": 1}))
            assert r.status_code == 422 and "unknown parameter" in r.json()["detail"]
    finally:
        app.state.pool.close()
