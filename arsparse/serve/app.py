"""The HTTP app: FastAPI over one model, the engine, and a scheduler per policy.

No ``from __future__ import annotations`` here: FastAPI reads the annotations of the route
functions, and the request model is built per app (its limits come from the model).
"""
import asyncio
import base64
import io
import secrets
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__, policies
from ..bundles import policy_guidance
from ..engine.continuous import supports_continuous
from ..engine.generator import resolve_device, resolve_dtype, row_keys, sampling_rows
from ..prompt_mask import pad_captions
from ..tokenizers import make_grid, to_pil
from .body_guard import BodyGuard, default_max_body_bytes
from .config import ServeConfig
from .metrics import CONTENT_TYPE, ServeMetrics
from .pool import SchedulerPool
from .scheduler import Job, ServeError
from .schemas import (ErrorResponse, GenerateResponse, HealthResponse, ModelInfo, ModelsResponse, PoliciesResponse,
                      PolicyInfo, generate_request_model)

STATIC = Path(__file__).parent / "static"


def _png(img) -> bytes:
    """Lossless PNG at zlib level 1: 2.6x faster than PIL's default 6 on a 384 px image (8 vs 21 ms
    on one core) for 14 % more bytes; at hundreds of images per second the encoding is server time."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body was read already: the server's next message is the
    disconnect, sent when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_detail(errors, example: str, allowed: list[str]) -> tuple[str, list[dict]]:
    """pydantic errors -> one message saying what was wrong and what is allowed, and one item per error."""
    items = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        kind, msg = e.get("type", ""), e.get("msg", "invalid")
        if kind == "json_invalid":
            err = (e.get("ctx") or {}).get("error", "JSON decode error")
            field, msg = "body", f"the body is not valid JSON ({err} at character {loc[0] if loc else '?'}); send a JSON object such as {example}"
        elif field == "body" and kind == "missing":
            msg = f"the body is missing; send a JSON object such as {example}"
        elif field == "body":
            msg = f"the body must be a JSON object (Content-Type: application/json) such as {example}"
        elif kind == "missing":
            msg = "required field is missing"
        elif kind == "extra_forbidden":
            msg = f"unknown field; allowed fields: {', '.join(allowed)}"
        else:
            got = repr(e.get("input"))
            msg = f"{msg} (got {got if len(got) <= 60 else got[:57] + '...'})"
        items.append(dict(field=field, message=msg))
    detail = "; ".join(f"{it['field']}: {it['message']}" if it["field"] != "body" else it["message"] for it in items)
    return f"invalid request: {detail}", items


def create_app(gpt, tokenizer, *, model_name: str = "model", policy: str = "dense", policy_args: dict | None = None,
               config: ServeConfig | None = None, device=None, dtype=None, cfg_scale: float = 4.0,
               policy_cfg_scales: dict[str, float] | None = None, class_names=None) -> FastAPI:
    """An ASGI app serving ``gpt`` + ``tokenizer`` (one copy, shared by every policy's scheduler).

    ``policy``/``policy_args``: the server's policy, used when a request names none (created now,
    so a bad one fails here). ``cfg_scale``: the guidance a request gets unless it asks;
    ``policy_cfg_scales``: guidance calibrated per policy at its default settings, which a request under
    that policy gets instead (:func:`~arsparse.bundles.policy_guidance`).
    """
    config = config or ServeConfig()
    sampling_rows(1, cfg_scale=cfg_scale)  # (a NaN or negative default guidance fails here, not in every request)
    if tokenizer is None:
        raise ValueError("the server needs a tokenizer to turn tokens into images")
    device = resolve_device(device)
    tokenizer.to(device, resolve_dtype(config.vq_dtype or dtype, device))  # the image decoder's precision
    pool = SchedulerPool(gpt, tokenizer, config, device=device, dtype=dtype, policy=policy, policy_args=policy_args)
    gen = pool.default.gen
    cfg = gen.config
    c2i = cfg.model_type == "c2i"
    guidance = not c2i or cfg.has_null_class
    if not guidance:
        cfg_scale, policy_cfg_scales = 1.0, None
    for g in (policy_cfg_scales or {}).values():
        sampling_rows(1, cfg_scale=g)  # (as the default's)
    height, width = tokenizer.image_size((cfg.grid_h, cfg.grid_w))
    GenerateRequest = generate_request_model(cfg, config.max_images, config.max_timeout_s, policies.names(), cfg_scale,
                                             policy_cfg_scales)
    allowed_fields = list(GenerateRequest.model_fields)
    example = '{"class_label": 0, "n": 1, "seed": 0}' if c2i else '{"caption_features": [[...]], "n": 1}'
    metrics = ServeMetrics(pool)

    # No lifespan hook closes the pool: test clients run the lifespan around every request. The worker
    # threads are daemons; app.state.pool.close() stops them and frees their caches.
    app = FastAPI(title="arsparse", version=__version__,
                  description="Autoregressive image generation with sparse attention and continuous batching.")
    app.state.pool, app.state.metrics, app.state.config = pool, metrics, config
    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes or default_max_body_bytes(cfg),
                       read_timeout_s=config.body_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        detail, items = _validation_detail(exc.errors(), example, allowed_fields)
        return JSONResponse(status_code=422, content=dict(detail=detail, errors=items))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, StarletteHTTPException):  # (BodyGuard's 408/413)
            exc = cause
        elif exc.status_code == 400:  # FastAPI could not read the body at all
            why = ("it nests deeper than the JSON parser allows; a generate request nests 5 levels at most"
                   if isinstance(cause, RecursionError) else f"{exc.detail}: {cause}" if cause else exc.detail)
            return JSONResponse(status_code=422, content=dict(
                detail=f"invalid request: the body could not be read as JSON ({why}); send a UTF-8 JSON "
                       f"object such as {example}"))
        detail = str(exc.detail)
        if exc.status_code in (404, 405):  # (say what is there)
            detail += (f": {request.method} {request.url.path}; this server answers POST /v1/generate and GET "
                       "/v1/models, /v1/policies, /health, /metrics, /docs, /openapi.json and /")
        return JSONResponse(status_code=exc.status_code, content=dict(detail=detail), headers=exc.headers)

    @app.exception_handler(ServeError)
    async def on_serve_error(request: Request, exc: ServeError):
        headers = {"Retry-After": str(int(exc.retry_after))} if exc.retry_after is not None else None
        return JSONResponse(status_code=exc.status, content=dict(detail=exc.message), headers=headers)

    def err(description: str, retry: bool = False) -> dict:
        out = {"model": ErrorResponse, "description": description}
        if retry:
            out["headers"] = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
        return out

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/health", response_model=HealthResponse, summary="liveness and per-policy load")
    async def health():
        return HealthResponse(status="ok", model=model_name, policies=[s.stats() for s in pool.schedulers()])

    @app.get("/v1/models", response_model=ModelsResponse, summary="the model this server runs")
    async def models():
        return ModelsResponse(models=[ModelInfo(
            name=model_name, model_type=cfg.model_type, num_classes=cfg.num_classes if c2i else None,
            class_names=list(class_names) if class_names else None,
            caption_shape=None if c2i else [cfg.cls_token_num, cfg.caption_dim], image_tokens=cfg.image_tokens,
            grid=[cfg.grid_h, cfg.grid_w], width=width, height=height, cfg_scale=cfg_scale, guidance=guidance,
            policy_cfg_scales=policy_cfg_scales or None, max_images=min(config.max_images, pool.default.slots),
            parameters=cfg.num_params())])

    @app.get("/v1/policies", response_model=PoliciesResponse, summary="sparse-attention policies a request may name")
    async def list_policies():
        rows = []
        for name in policies.names():
            p = policies.get(name)
            d = p.describe()
            rows.append(PolicyInfo(name=name, kind=d["kind"], mode="continuous" if supports_continuous(p) else "cohort",
                                   source=d["source"], doc=d["doc"], params=d["params"]))
        return PoliciesResponse(default=pool.default_name, default_params=pool.default_args,
                                live=[s.name for s in pool.schedulers()], policies=rows)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "text format"}})
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/generate", response_model=GenerateResponse, summary="draw images",
              responses={200: {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}},
                               "description": "base64 PNGs in JSON; one PNG (a grid when n > 1) with Accept: image/png"},
                         422: err("bad input: what was wrong and what is allowed"),
                         429: err("the queue is full, or every policy slot is busy", retry=True),
                         499: err("the client went away (never seen by it)"),
                         500: err("the engine failed on this request"),
                         503: err("the policy is shutting down", retry=True),
                         504: err("the request timed out (timeout_s)")})
    async def generate(body: GenerateRequest, request: Request):
        t0 = time.monotonic()
        status, label = 500, body.policy or pool.default_name
        try:
            response = await _generate(body, request, t0)
            status = response.status_code
            return response
        except ServeError as e:
            status = e.status
            raise
        finally:
            metrics.observe(label, status, time.monotonic() - t0)

    async def _generate(body, request: Request, t0: float) -> Response:
        n = body.n
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        scale = body.cfg_scale
        if scale is None and policy_cfg_scales:
            try:
                key, args = pool.resolve(body.policy, body.policy_args)
                scale = policy_guidance(policy_cfg_scales, cfg_scale, key[0], args)
            except ValueError as e:  # PolicyError: unknown parameter, out of range
                raise ServeError(422, f"policy: {e}") from None
        scale = cfg_scale if scale is None else scale
        if not guidance and scale != 1.0:
            raise ServeError(422, "cfg_scale: this model has no null class, so guidance is unavailable; use 1")
        prompt_mask = None
        if c2i:
            cond = torch.full((n,), body.class_label, dtype=torch.long)
        else:
            feats, keep = pad_captions(torch.tensor(body.caption_features, dtype=torch.float32)[None], None,
                                       cfg.cls_token_num)  # (1, P, C), (1, P)
            cond = feats.expand(n, -1, -1)
            prompt_mask = None if bool(keep.all()) else keep.expand(n, -1)
        try:
            rows = sampling_rows(n, scale, body.temperature, body.top_k, body.top_p, body.cfg_interval)
        except ValueError as e:
            raise ServeError(422, str(e)) from None
        job = Job(cond, row_keys(seed, n), rows, deadline=t0 + (body.timeout_s or config.timeout_s), submitted=t0,
                  prompt_mask=prompt_mask)
        try:
            sched = await run_in_threadpool(pool.submit, body.policy, body.policy_args, job)
        except ValueError as e:  # PolicyError: unknown parameter, out of range, does not fit this model
            raise ServeError(422, f"policy: {e}") from None

        # Wait for the answer or the client's leaving, whichever comes first: no polling (hundreds of
        # waiting requests polling would keep the event loop, and so the GIL, busy).
        fut = asyncio.wrap_future(job.future)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not fut.done():
            sched.cancel(job)  # the worker frees its slots at the next step boundary
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            return Response(status_code=499)
        result = fut.result()  # raises the ServeError the worker set

        accept = request.headers.get("accept", "")
        want_png = "image/png" in accept and "application/json" not in accept
        total = time.monotonic() - t0
        timing = dict(queue_s=round(result.queue_s, 4), generate_s=round(result.run_s, 4), total_s=round(total, 4))
        headers = {"X-Request-Id": job.id, "X-Seed": str(seed), "X-Policy": sched.name,
                   "X-Time-Total": f"{total:.4f}"}
        if want_png:
            png = await run_in_threadpool(lambda: _png(make_grid(result.images, nrow=min(n, 8))))
            return Response(png, media_type="image/png", headers=headers)
        images = await run_in_threadpool(lambda: [base64.b64encode(_png(im)).decode() for im in to_pil(result.images)])
        out = GenerateResponse(
            id=job.id, model=model_name, seed=seed, n=n, width=width, height=height, images=images,
            policy=dict(name=sched.gen.policy.name, label=sched.name, mode=sched.mode),
            tokens=result.tokens.tolist() if body.return_tokens else None, timing=timing)
        return JSONResponse(out.model_dump(), headers=headers)

    return app
