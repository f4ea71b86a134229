"""The server under load on loopback: nothing lost, duplicated or mixed up; backpressure, timeouts, cancellation."""
import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'arsparse[serve]'")
import httpx  # noqa: E402

from arsparse.engine.generator import row_keys, sampling_rows  # noqa: E402
from arsparse.serve.loadgen import ServerThread, drive, drive_summary, percentile, serve_bench  # noqa: E402
from arsparse.serve.scheduler import Job, ServeError, WorkerClock  # noqa: E402
from arsparse.tokenizers import to_pil  # noqa: E402
from serve_util import DIAGONAL_4x4, b64_pixels, make_app, offline_pixels, offline_tokens, tiny_model  # noqa: E402


def _bodies(count: int, seed: int, policies: list) -> list[dict]:
    """Fresh random requests with distinct seeds, mixing policies, guidance and sampling filters."""
    rng = random.Random(seed)
    seeds = rng.sample(range(2**31), count)
    out = []
    for i in range(count):
        policy, args = policies[i % len(policies)]
        body = dict(class_label=rng.randrange(7), n=rng.randint(1, 3), seed=seeds[i], return_tokens=True,
                    cfg_scale=rng.choice([1.0, 2.0, 3.5]), temperature=rng.choice([0.5, 1.0, 1.3]),
                    top_k=rng.choice([0, 0, 8]), top_p=rng.choice([1.0, 1.0, 0.9]))
        if policy is not None:
            body.update(policy=policy, policy_args=args)
        out.append(body)
    return out


def _slow_steps(sched, seconds: float) -> None:
    """Make every decode step of ``sched`` take at least ``seconds`` (so requests stay in flight)."""
    step = sched.decoder.step

    def slow():
        time.sleep(seconds)
        return step()

    sched.decoder.step = slow


def _wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_load_200_requests_from_32_clients_each_gets_its_own_images():
    gpt, tok = tiny_model(seed=5)
    app = make_app(gpt, tok, max_batch=16, max_images=3, max_queue=256, max_policies=2)
    bodies = _bodies(200, seed=1, policies=[(None, None), ("diagonal", DIAGONAL_4x4)])
    with ServerThread(app) as srv:
        records = asyncio.run(drive(srv.url, bodies, concurrency=32, timeout=120))
        stats = {s["policy"]: s for s in httpx.get(srv.url + "/health").json()["policies"]}
        metrics = httpx.get(srv.url + "/metrics").text
    failures = [(r["status"], r["json"]) for r in records if r["status"] != 200]
    assert not failures, failures[:3]
    ids = [r["json"]["id"] for r in records]
    assert len(set(ids)) == len(ids) == 200  # none lost, none answered twice
    for body, r in zip(bodies, records):
        data = r["json"]
        assert data["seed"] == body["seed"] and data["n"] == body["n"]
        want = offline_tokens(gpt, body)
        assert torch.equal(torch.tensor(data["tokens"]), want), f"request {r['index']} got another request's tokens"
        for got, ref in zip(data["images"], offline_pixels(tok, gpt, want)):
            assert np.array_equal(b64_pixels(got), ref)
    # Requests were really batched together, under both policies, and the pools are empty again.
    assert stats["dense"]["max_running_images"] >= 8 and stats["diagonal:local=3,rows=1,band=1,sinks=1"]["max_running_images"] >= 8
    assert all(s["running_images"] == 0 and s["queue_length"] == 0 and s["kv_bytes_in_use"] == 0 for s in stats.values())
    assert sum(s["completed"] for s in stats.values()) == 200
    assert 'arsparse_requests_total{policy="dense",status="200"} 100.0' in metrics
    lat = [r["latency_s"] for r in records]
    assert 0 < percentile(lat, 50) <= percentile(lat, 99)


def test_cohort_policy_batches_requests_that_arrive_together():
    gpt, tok = tiny_model(seed=6)
    app = make_app(gpt, tok, policy="h2o", policy_args=dict(rho=0.5), max_batch=16, max_images=3)
    sched = app.state.pool.default
    assert sched.mode == "cohort"
    bodies = _bodies(24, seed=2, policies=[("h2o", dict(rho=0.5))])
    with ServerThread(app) as srv:
        records = asyncio.run(drive(srv.url, bodies, concurrency=8, timeout=120))
    assert [r["status"] for r in records] == [200] * len(bodies), [r["json"] for r in records if r["status"] != 200][:2]
    for body, r in zip(bodies, records):
        assert r["json"]["policy"]["mode"] == "cohort"
        assert torch.equal(torch.tensor(r["json"]["tokens"]), offline_tokens(gpt, body))
    assert sched.max_running > 3  # several requests shared a batch


def _job(gpt, label: int, seed: int, timeout: float = 60.0) -> Job:
    return Job(torch.tensor([label]), row_keys(seed, 1), sampling_rows(1, cfg_scale=2.0),
               deadline=time.monotonic() + timeout)


def test_full_queue_gets_429_with_retry_after_and_loses_nothing():
    gpt, tok = tiny_model(seed=7)
    app = make_app(gpt, tok, max_batch=1, max_images=1, max_queue=2)
    sched = app.state.pool.default
    gate = threading.Event()
    step = sched.decoder.step
    sched.decoder.step = lambda: (gate.wait(), step())[1]
    jobs = [_job(gpt, 1, 10), _job(gpt, 2, 11), _job(gpt, 3, 12)]
    sched.submit(jobs[0])
    assert _wait_for(lambda: sched.running_images() == 1)  # admitted, then held at the gate
    sched.submit(jobs[1])
    sched.submit(jobs[2])
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/generate", json=dict(class_label=4, seed=13))
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert "queue" in r.json()["detail"] and "full" in r.json()["detail"]
        with pytest.raises(ServeError) as e:
            sched.submit(_job(gpt, 4, 14))
        assert e.value.status == 429
        gate.set()
        for job, (label, seed) in zip(jobs, [(1, 10), (2, 11), (3, 12)]):
            tokens = job.future.result(timeout=30).tokens
            assert torch.equal(tokens, offline_tokens(gpt, dict(class_label=label, seed=seed)))
        r = httpx.post(srv.url + "/v1/generate", json=dict(class_label=4, seed=13, return_tokens=True))
        assert r.status_code == 200  # accepted again once the queue drained
        assert torch.equal(torch.tensor(r.json()["tokens"]), offline_tokens(gpt, dict(class_label=4, seed=13)))


def test_timeouts_while_running_and_while_queued_free_the_slots():
    gpt, tok = tiny_model(seed=8)
    app = make_app(gpt, tok, max_batch=1, max_images=1)
    sched = app.state.pool.default
    _slow_steps(sched, 0.03)  # 16 tokens: ~0.5 s per request
    with ServerThread(app) as srv:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/generate", json=dict(class_label=1, seed=1, timeout_s=0.15))
        assert r.status_code == 504 and "timed out" in r.json()["detail"] and "timeout_s" in r.json()["detail"]
        assert time.monotonic() - t0 < 0.45  # dropped mid-flight, not at the end
        assert sched.running_images() == 0 and sched.decoder.free_slots() == [0]

        # One request runs; another with a short deadline waits behind it and times out in the queue.
        bodies = [dict(class_label=2, seed=2, return_tokens=True), dict(class_label=3, seed=3, timeout_s=0.15)]
        records = asyncio.run(drive(srv.url, bodies, concurrency=2))
        assert [r["status"] for r in records] == [200, 504]
        assert torch.equal(torch.tensor(records[0]["json"]["tokens"]), offline_tokens(gpt, bodies[0]))
        metrics = httpx.get(srv.url + "/metrics").text
    assert 'arsparse_requests_total{policy="dense",status="504"} 2.0' in metrics


def test_a_client_that_goes_away_frees_its_slots():
    gpt, tok = tiny_model(seed=9)
    app = make_app(gpt, tok, max_batch=2, max_images=2)
    sched = app.state.pool.default
    _slow_steps(sched, 0.1)  # 16 tokens: ~1.6 s per request
    with ServerThread(app) as srv:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/generate", json=dict(class_label=1, n=2, seed=1), timeout=0.3)
        assert sched.running_images() == 2  # still decoding when the client left
        assert _wait_for(lambda: sched.running_images() == 0, timeout=5)
        assert time.monotonic() - t0 < 1.2  # freed well before the request would have finished
        assert sched.decoder.free_slots() == [0, 1]
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'status="499"} 1.0' in metrics
        r = httpx.post(srv.url + "/v1/generate", json=dict(class_label=5, n=2, seed=4, return_tokens=True), timeout=30)
        assert r.status_code == 200
        assert torch.equal(torch.tensor(r.json()["tokens"]), offline_tokens(gpt, dict(class_label=5, n=2, seed=4)))


def test_policy_pool_closes_idle_policies_and_refuses_when_all_are_busy():
    gpt, tok = tiny_model(seed=10)
    app = make_app(gpt, tok, max_batch=2, max_images=1, max_policies=2)
    pool = app.state.pool
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        r = client.post("/v1/generate", json=dict(class_label=1, seed=1, policy="streaming", policy_args=dict(recent=4)))
        assert r.status_code == 200 and r.json()["policy"]["label"] == "streaming:recent=4"
        r = client.post("/v1/generate", json=dict(class_label=1, seed=1, policy="diagonal", policy_args=DIAGONAL_4x4))
        assert r.status_code == 200  # the idle streaming pool was closed to make room
        assert sorted(s.name for s in pool.schedulers()) == ["dense", "diagonal:local=3,rows=1,band=1,sinks=1"]
        # Keep diagonal busy: a third policy cannot get a pool now.
        busy = [s for s in pool.schedulers() if s.name.startswith("diagonal")][0]
        gate = threading.Event()
        step = busy.decoder.step
        busy.decoder.step = lambda: (gate.wait(), step())[1]
        busy.submit(_job(gpt, 1, 5))
        r = client.post("/v1/generate", json=dict(class_label=1, policy="streaming"))
        assert r.status_code == 429 and "at most 2 policies" in r.json()["detail"] and "retry-after" in r.headers
        gate.set()
    pool.close()


def test_a_policy_being_built_does_not_block_health_or_live_policies():
    """A new policy's scheduler is built (and a calibrated one calibrated) outside the pool's lock: /health
    and requests for the live policy answer meanwhile, and a second request for the same new policy waits
    for that one build instead of starting another."""
    gpt, tok = tiny_model(seed=12)
    app = make_app(gpt, tok, max_batch=2, max_images=1, max_policies=2)
    pool = app.state.pool
    gate, building, builds = threading.Event(), threading.Event(), []
    create = pool._create

    def slow_create(policy):
        builds.append(policy.name)
        building.set()
        gate.wait(30)
        return create(policy)

    pool._create = slow_create
    from fastapi.testclient import TestClient

    body = dict(class_label=1, seed=1, policy="streaming", policy_args=dict(recent=4), return_tokens=True)
    with TestClient(app) as client:
        answers = []
        new = [threading.Thread(target=lambda: answers.append(client.post("/v1/generate", json=body)))
               for _ in range(2)]
        for t in new:
            t.start()
        assert building.wait(30)
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        r = client.post("/v1/generate", json=dict(class_label=2, seed=3, return_tokens=True))  # the live dense
        assert r.status_code == 200 and time.monotonic() - t0 < 20
        assert not answers  # still building
        gate.set()
        for t in new:
            t.join(60)
    assert [a.status_code for a in answers] == [200, 200] and builds == ["streaming"]
    assert answers[0].json()["tokens"] == answers[1].json()["tokens"]
    assert torch.equal(torch.tensor(answers[0].json()["tokens"]), offline_tokens(gpt, body))
    pool.close()


def test_serve_bench_reports_throughput_latency_batch_and_the_worker_breakdown():
    gpt, tok = tiny_model(seed=11)
    app = make_app(gpt, tok, max_batch=8)
    out = serve_bench(app, "tiny", requests=24, concurrency=8, n=2, warmup=4, num_classes=7)  # clients: a process
    assert out["failures"] == 0 and out["failure_details"] == [] and out["retries"] == 0 and out["client_process"]
    assert out["requests"] == 24 and out["images_per_request"] == 2
    assert out["requests_per_s"] > 0 and out["images_per_s"] == pytest.approx(2 * out["requests_per_s"])
    assert 0 < out["latency_p50_s"] <= out["latency_p99_s"]
    assert out["mode"] == "continuous" and 4 <= out["max_running_images"] <= out["slots"] == 8
    w = out["worker"]  # the timed part only: the warmup's requests are not counted
    assert w["admitted_requests"] == w["finished_requests"] == 24 and 1 <= w["admissions"] <= 24
    assert 1 <= w["finish_batches"] <= 24 and w["steps"] >= 15  # 16 tokens: 15 steps after the prefill at least
    phases = sum(w[f"{p}_s"] for p in WorkerClock.PHASES)
    assert phases == pytest.approx(w["worker_s"], abs=1e-6) and 0 < w["worker_s"] <= out["seconds"] + 1.0
    assert w["step_s"] > 0 and w["admit_s"] > 0 and w["finish_s"] > 0


def test_serve_bench_keeps_the_first_failures_with_their_reasons():
    gpt, tok = tiny_model(seed=12)
    app = make_app(gpt, tok, max_batch=2, max_images=1)
    _slow_steps(app.state.pool.default, 0.01)
    out = serve_bench(app, "tiny", requests=7, concurrency=3, warmup=0, num_classes=7, body=dict(timeout_s=0.05),
                      client_process=False)
    assert out["failures"] == 7 and out["failure_statuses"] == [504] and out["requests_per_s"] == 0
    details = out["failure_details"]
    assert len(details) == 5 and all(d["status"] == 504 and "timed out" in d["detail"] for d in details)
    assert len({d["index"] for d in details}) == 5


def test_clients_retry_429_after_retry_after_and_count_it():
    gpt, tok = tiny_model(seed=13)
    app = make_app(gpt, tok, max_batch=1, max_images=1, max_queue=1)
    _slow_steps(app.state.pool.default, 0.01)  # ~0.2 s per request: one runs, one waits, the rest get 429
    bodies = [dict(class_label=i, seed=100 + i, return_tokens=True) for i in range(4)]
    with ServerThread(app) as srv:
        refused = asyncio.run(drive(srv.url, bodies, concurrency=4, retry_busy=False))
        assert sorted(r["status"] for r in refused).count(429) >= 1 and all(r["retries"] == 0 for r in refused)
        records = asyncio.run(drive(srv.url, bodies, concurrency=4))
        slim, _ = drive_summary(srv.url, [dict(class_label=99, seed=1)], concurrency=1)
    assert [r["status"] for r in records] == [200] * 4
    assert sum(r["retries"] for r in records) >= 1
    for body, r in zip(bodies, records):
        assert torch.equal(torch.tensor(r["json"]["tokens"]), offline_tokens(gpt, body))
        if r["retries"]:
            assert r["latency_s"] >= 1.0  # it waited Retry-After (whole seconds, >= 1) before sending again
    assert slim[0]["status"] == 422 and "class_label" in slim[0]["detail"] and slim[0]["images"] == 0


def test_requests_finishing_on_one_step_share_one_image_decode_and_each_gets_its_own():
    gpt, tok = tiny_model(seed=14)
    app = make_app(gpt, tok, max_batch=8, max_images=3)
    sched = app.state.pool.default
    gate = threading.Event()
    admit = sched._admit
    sched._admit = lambda: (gate.wait(), admit())[1]  # hold the worker until every job is queued
    jobs = [Job(torch.tensor([label] * n), row_keys(seed, n), sampling_rows(n, cfg_scale=2.0),
                deadline=time.monotonic() + 60) for label, n, seed in [(1, 1, 21), (4, 3, 22), (2, 2, 23), (6, 1, 24)]]
    before = sched.clock.snapshot()
    for job in jobs:
        sched.submit(job)
    gate.set()
    results = [job.future.result(timeout=60) for job in jobs]
    assert _wait_for(lambda: sched.idle())
    after = sched.clock.snapshot()
    app.state.pool.close()
    for job, res, (label, n, seed) in zip(jobs, results, [(1, 1, 21), (4, 3, 22), (2, 2, 23), (6, 1, 24)]):
        want = offline_tokens(gpt, dict(class_label=label, n=n, seed=seed))
        assert torch.equal(res.tokens, want)
        got = [np.asarray(im.convert("RGB")) for im in to_pil(res.images)]
        assert all(np.array_equal(g, ref) for g, ref in zip(got, offline_pixels(tok, gpt, want))) and len(got) == n
    count = {k: after[k] - before[k] for k in ("admissions", "admitted_requests", "finish_batches", "finished_requests")}
    assert count == dict(admissions=1, admitted_requests=4, finish_batches=1, finished_requests=4)
    assert after["steps"] - before["steps"] == 15  # 16 tokens: the first from the prefill
    phases = sum(after[f"{p}_s"] for p in WorkerClock.PHASES)
    assert phases == pytest.approx(after["worker_s"], abs=1e-6)
