"""Serving on a loopback port in-process, a closed-loop load driver, and ``arsparse serve-bench``."""
from __future__ import annotations

import asyncio
import math
import multiprocessing
import platform
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import httpx
import uvicorn

from .http_errors import JsonErrorH11Protocol


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (loopback by default) in a background thread.

    A context manager: ``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``.
    ``port=0`` picks a free port.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                                    http=JsonErrorH11Protocol))
        self.thread = threading.Thread(target=self.server.run, name="arsparse-uvicorn", daemon=True)
        self.host = host

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        pool = getattr(getattr(self.server.config.app, "state", None), "pool", None)
        if pool is not None:  # an arsparse app: stop its decode threads too
            pool.close()


async def drive(url: str, bodies: list[dict], concurrency: int, timeout: float = 600.0,
                headers: dict | None = None, retry_busy: bool = True) -> list[dict]:
    """POST every body to ``/v1/generate`` from ``concurrency`` clients, each sending its next as soon as
    its last is answered (a closed loop). A 429 with Retry-After is sent again after that many seconds
    (``retry_busy``; while ``timeout`` lasts), as a well-behaved client does.

    -> one record per body, in order: index, status (the last answer's; -1: no answer, the client
    raised), latency_s (from the first attempt), retries (429s retried), the JSON answer (or None; for
    -1 ``{"detail": the exception}``) and the response headers.
    """
    records: list[dict | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def post(client: httpx.AsyncClient, body: dict) -> tuple[int, dict | None, dict]:
        try:
            r = await client.post("/v1/generate", json=body, headers=headers)
        except httpx.HTTPError as e:
            return -1, {"detail": f"{type(e).__name__}: {e!r}"}, {}
        data = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
        return r.status_code, data, dict(r.headers)

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in next_index:
            t0, retries = time.perf_counter(), 0
            while True:
                status, data, hdrs = await post(client, bodies[i])
                wait = _retry_after(hdrs) if status == 429 and retry_busy else None
                if wait is None or time.perf_counter() - t0 + wait > timeout:
                    break
                retries += 1
                await asyncio.sleep(wait)
            records[i] = dict(index=i, status=status, latency_s=time.perf_counter() - t0, retries=retries, json=data,
                              headers=hdrs)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return records


def _retry_after(headers: dict) -> float | None:
    """Seconds a Retry-After header asks for (None: none given, or not a number of seconds)."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def drive_summary(url: str, bodies: list[dict], concurrency: int, timeout: float = 600.0) -> tuple[list[dict], float]:
    """:func:`drive`, timed, with each record cut to what a benchmark keeps: index, status, latency_s,
    retries, images (how many came back) and detail (why not, for a failure). -> (records, seconds)."""
    t0 = time.perf_counter()
    records = asyncio.run(drive(url, bodies, concurrency, timeout))
    elapsed = time.perf_counter() - t0
    slim = []
    for r in records:
        data = r["json"] if isinstance(r["json"], dict) else {}
        slim.append(dict(index=r["index"], status=r["status"], latency_s=r["latency_s"], retries=r["retries"],
                         images=len(data.get("images") or []), detail=None if r["status"] == 200 else data.get("detail")))
    return slim, elapsed


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _worker_delta(before: dict, after: dict) -> dict:
    """The worker clock over an interval (``after`` - ``before`` of :meth:`WorkerClock.snapshot`)."""
    out = {k: after[k] - before[k] for k in after if k not in ("step_ms", "busy_ms_per_step")}
    steps = max(1, out["steps"])
    out.update(step_ms=1e3 * out["step_s"] / steps, busy_ms_per_step=1e3 * (out["worker_s"] - out["idle_s"]) / steps)
    return out


FAILURES_KEPT = 5  # failure details a serve-bench JSON keeps


def serve_bench(app, model: str, requests: int, concurrency: int, n: int = 1, warmup: int | None = None,
                num_classes: int = 1, body: dict | None = None, client_process: bool = True) -> dict:
    """Start ``app`` on a loopback port, warm it up, then drive ``requests`` requests of ``n`` images
    from ``concurrency`` clients. -> requests/s, images/s, tokens/s, latency percentiles, the largest
    running batch, the worker's time breakdown over the timed part (``worker``), 429 retries and the
    first few failures, as a JSON-able dict (strict JSON: the latency figures are None when no request
    succeeded). ``failures``: requests that never got their images.

    ``client_process``: the clients run in a process of their own (spawned), so that their Python
    work (JSON, base64) does not compete with the server for this process's GIL, as in a deployment.
    """
    import torch

    warmup = concurrency if warmup is None else warmup
    extra = dict(body or {})

    def bodies(count: int, offset: int) -> list[dict]:
        return [dict(class_label=(offset + i) % num_classes, n=n, seed=offset + i, **extra) for i in range(count)]

    gen = app.state.pool.default.gen
    with ServerThread(app) as srv, ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        def run(batch: list[dict]) -> tuple[list[dict], float]:
            if client_process:
                return ex.submit(drive_summary, srv.url, batch, concurrency).result()
            return drive_summary(srv.url, batch, concurrency)

        if warmup:
            run(bodies(warmup, 10**6))
        before = httpx.get(srv.url + "/health").json()["policies"][0]
        records, elapsed = run(bodies(requests, 0))
        stats = httpx.get(srv.url + "/health").json()["policies"][0]
    ok = [r for r in records if r["status"] == 200 and r["images"] == n]
    failed = [r for r in records if not (r["status"] == 200 and r["images"] == n)]
    lat = [r["latency_s"] for r in ok]
    tokens = gen.config.image_tokens
    return _finite(dict(
        model=model, policy=stats["policy"], mode=stats["mode"], device=str(gen.device), dtype=str(gen.dtype),
        gpu=torch.cuda.get_device_name(gen.device) if gen.device.type == "cuda" else None, torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"), host=platform.node(), requests=requests, concurrency=concurrency,
        images_per_request=n, warmup_requests=warmup, client_process=client_process,
        max_queue=app.state.config.max_queue, failures=len(failed),
        failure_statuses=sorted({r["status"] for r in failed}),
        failure_details=[dict(index=r["index"], status=r["status"], detail=r["detail"]) for r in failed[:FAILURES_KEPT]],
        retries=sum(r["retries"] for r in records), retried_requests=sum(r["retries"] > 0 for r in records),
        seconds=elapsed, requests_per_s=len(ok) / elapsed, images_per_s=len(ok) * n / elapsed,
        tokens_per_s=len(ok) * n * tokens / elapsed,
        latency_p50_s=percentile(lat, 50), latency_p90_s=percentile(lat, 90), latency_p99_s=percentile(lat, 99),
        latency_mean_s=sum(lat) / len(lat) if lat else None, max_running_images=stats["max_running_images"],
        slots=stats["slots"], kv_bytes_capacity=stats["kv_bytes_capacity"],
        worker=_worker_delta(before["worker"], stats["worker"])))


def _finite(obj):
    """``obj`` with every NaN or infinite float (e.g. the latency percentiles when no request succeeded)
    as None, so that it is strict JSON (null) rather than Python's bare NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
