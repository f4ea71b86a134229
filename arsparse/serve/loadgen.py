"""Serving on a loopback port in-process, a closed-loop load driver, and ``arsparse serve-bench``."""
from __future__ import annotations

import asyncio
import platform
import threading
import time

import httpx
import uvicorn


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (loopback by default) in a background thread.

    A context manager: ``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``.
    ``port=0`` picks a free port.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
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
                headers: dict | None = None) -> list[dict]:
    """POST every body to ``/v1/generate`` from ``concurrency`` clients, each sending its next as soon as
    its last is answered (a closed loop). -> one record per body, in order: index, status, latency_s,
    the JSON answer (or None) and the response headers."""
    records: list[dict | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in next_index:
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/generate", json=bodies[i], headers=headers)
                status, data, hdrs = r.status_code, None, dict(r.headers)
                if r.headers.get("content-type", "").startswith("application/json"):
                    data = r.json()
            except httpx.HTTPError as e:
                status, data, hdrs = -1, {"detail": f"{type(e).__name__}: {e}"}, {}
            records[i] = dict(index=i, status=status, latency_s=time.perf_counter() - t0, json=data, headers=hdrs)

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return records


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def serve_bench(app, model: str, requests: int, concurrency: int, n: int = 1, warmup: int | None = None,
                num_classes: int = 1, body: dict | None = None) -> dict:
    """Start ``app`` on a loopback port, warm it up, then drive ``requests`` requests of ``n`` images
    from ``concurrency`` clients. -> requests/s, images/s, tokens/s, latency percentiles and the
    largest running batch the default policy reached, as a JSON-able dict."""
    import torch

    warmup = concurrency if warmup is None else warmup
    extra = dict(body or {})

    def bodies(count: int, offset: int) -> list[dict]:
        return [dict(class_label=(offset + i) % num_classes, n=n, seed=offset + i, **extra) for i in range(count)]

    gen = app.state.pool.default.gen
    with ServerThread(app) as srv:
        asyncio.run(drive(srv.url, bodies(warmup, 10**6), concurrency))
        t0 = time.perf_counter()
        records = asyncio.run(drive(srv.url, bodies(requests, 0), concurrency))
        elapsed = time.perf_counter() - t0
        stats = httpx.get(srv.url + "/health").json()["policies"][0]
    ok = [r for r in records if r["status"] == 200]
    lat = [r["latency_s"] for r in ok]
    tokens = gen.config.image_tokens
    return dict(
        model=model, policy=stats["policy"], mode=stats["mode"], device=str(gen.device), dtype=str(gen.dtype),
        gpu=torch.cuda.get_device_name(gen.device) if gen.device.type == "cuda" else None, torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"), host=platform.node(), requests=requests, concurrency=concurrency,
        images_per_request=n, warmup_requests=warmup, failures=len(records) - len(ok),
        failure_statuses=sorted({r["status"] for r in records if r["status"] != 200}), seconds=elapsed,
        requests_per_s=len(ok) / elapsed, images_per_s=len(ok) * n / elapsed, tokens_per_s=len(ok) * n * tokens / elapsed,
        latency_p50_s=percentile(lat, 50), latency_p90_s=percentile(lat, 90), latency_p99_s=percentile(lat, 99),
        latency_mean_s=sum(lat) / max(1, len(lat)), max_running_images=stats["max_running_images"], slots=stats["slots"],
        kv_bytes_capacity=stats["kv_bytes_capacity"])
