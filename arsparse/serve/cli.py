"""``arsparse serve`` and ``arsparse serve-bench`` (thin: they build a model and an app, then run it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cliargs import add_model_args, build_model, finite_float, need_extra, positive_int


def _need_serve_extra() -> None:
    need_extra("serve", "serving needs", "fastapi", "httpx", "prometheus_client", "uvicorn")


def _app_from_args(args, max_queue: int = 64):
    from ..bundles import BUNDLES
    from ..policies import get, parse_args, parse_spec
    from .app import create_app
    from .config import ServeConfig

    _need_serve_extra()
    policy, own = parse_spec(args.policy)  # ("diagonal:rows=2" as generate, eval and bench take it; its settings win)
    policy_args = {**parse_args(args.policy_arg), **own}
    get(policy, **policy_args)  # a bad policy fails before the model loads
    config = ServeConfig(max_batch=args.max_batch, kv_memory_gb=args.kv_memory_gb, max_queue=args.max_queue or max_queue,
                         max_images=min(args.max_images, args.max_batch), timeout_s=args.timeout,
                         max_timeout_s=max(args.timeout, 600.0), max_policies=args.max_policies,
                         cuda_graphs=not args.no_cuda_graphs, compile=args.compile, vq_dtype=args.vq_dtype)
    gpt, tok, name, cfg_scale = build_model(args)
    bundle = BUNDLES.get(name)
    app = create_app(gpt, tok, model_name=name, policy=policy, policy_args=policy_args, config=config,
                     device=args.device, dtype=args.dtype, cfg_scale=cfg_scale if args.cfg_scale is None else args.cfg_scale,
                     policy_cfg_scales=dict(bundle.policy_cfg_scales) if bundle and args.cfg_scale is None else None,
                     class_names=bundle.class_names if bundle else None)
    return app, name, gpt


def cmd_serve(args) -> int:
    _need_serve_extra()
    import uvicorn

    app, name, _ = _app_from_args(args)
    sched = app.state.pool.default
    print(f"arsparse: serving {name} on http://{args.host}:{args.port} (policy {sched.name}, {sched.mode} batching, "
          f"{sched.slots} slots, {sched.gen.device}); docs at /docs, page at /", flush=True)
    from .http_errors import JsonErrorH11Protocol

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=JsonErrorH11Protocol)
    return 0


def cmd_serve_bench(args) -> int:
    limit = min(args.max_images, args.max_batch)  # (what the server's requests may ask for: ServeConfig.max_images)
    if args.n > limit:  # (else every request is refused with 422 and nothing is measured)
        low = " and ".join(f for f, v in (("--max-images", args.max_images), ("--max-batch", args.max_batch)) if v < args.n)
        raise ValueError(f"--n {args.n} is more images per request than the server takes: at most {limit} "
                         f"(--max-images {args.max_images}, --max-batch {args.max_batch}); lower --n or raise {low}")
    _need_serve_extra()
    from .loadgen import serve_bench

    # A steady load of C closed-loop clients has at most C requests waiting: size the queue for them,
    # so that the benchmark measures serving rather than backpressure (unless --max-queue says otherwise).
    app, name, gpt = _app_from_args(args, max_queue=max(64, args.concurrency))
    cfg = gpt.config
    if cfg.model_type != "c2i":
        raise ValueError("serve-bench drives class-conditional models only")
    body = {} if args.cfg_scale is None else dict(cfg_scale=args.cfg_scale)
    result = serve_bench(app, name, args.requests, args.concurrency, n=args.n, warmup=args.warmup,
                         num_classes=cfg.num_classes, body=body, client_process=not args.client_in_process)
    w = result["worker"]
    print(f"worker over the timed run: {w['steps']} steps, {w['step_ms']:.2f} ms host time per step launch, "
          f"{w['busy_ms_per_step']:.2f} ms busy per step; seconds: step {w['step_s']:.2f}, waiting for the device "
          f"{w['device_s']:.2f}, admit {w['admit_s']:.2f} "
          f"({w['admissions']} prefills, {w['admitted_requests']} requests), finish {w['finish_s']:.2f} "
          f"({w['finish_batches']} batches, {w['finished_requests']} requests), idle {w['idle_s']:.2f}, "
          f"other {w['other_s']:.2f}; {result['retries']} retries after 429, {result['failures']} failures",
          flush=True)
    text = json.dumps(result, indent=2, allow_nan=False)  # (strict JSON: serve_bench gives null, never NaN)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0 if result["failures"] == 0 else 1


def _add_server_args(p) -> None:
    add_model_args(p)
    p.add_argument("--policy", default="dense", help="the server's policy, optionally with its settings: "
                   "diagonal:rows=2,band=1 (these win over --policy-arg; requests may name another)")
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE", help="its parameters, repeatable")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--cfg-scale", type=finite_float, default=None, help="guidance when a request gives none (default: the bundle's, "
                   "for a policy with a calibrated one at its default settings that one: see /v1/models)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="images decoded at once per policy, at most")
    p.add_argument("--kv-memory-gb", type=float, default=None,
                   help="KV cache budget per policy; sets the slot pool (default: free GPU memory on cuda)")
    p.add_argument("--max-queue", type=positive_int, default=None,
                   help="waiting requests per policy before 429 (default: 64; serve-bench: max(64, --concurrency))")
    p.add_argument("--max-images", type=positive_int, default=8, help="images per request, at most")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take unless it asks (504 after)")
    p.add_argument("--max-policies", type=positive_int, default=2, help="policies with a live slot pool at once")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every continuous-batching step eagerly")
    p.add_argument("--vq-dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="precision of the image decoder (default: --dtype's)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the transformer blocks (any batch size; slow to build at the first requests)")


def port_number(text: str) -> int:
    if not (text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {text!r}")
    return int(text)


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="HTTP server with continuous batching, a web page and Prometheus metrics")
    _add_server_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("serve-bench", help="start the server in-process and time a steady load against it")
    _add_server_args(b)
    b.add_argument("--requests", type=positive_int, default=256, help="timed requests")
    b.add_argument("--concurrency", type=positive_int, default=32, help="clients, each with one request in flight")
    b.add_argument("--n", type=positive_int, default=1, help="images per request (at most --max-images)")
    b.add_argument("--warmup", type=int, default=None, help="untimed requests first (default: --concurrency)")
    b.add_argument("--client-in-process", action="store_true",
                   help="run the clients in the server's process (default: a process of their own)")
    b.add_argument("--out", help="write the JSON here too")
    b.set_defaults(func=cmd_serve_bench)
