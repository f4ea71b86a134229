"""The generation engine: static cache, guidance, sampling without host syncs, CUDA graphs."""
from __future__ import annotations

import gc
import math
import numbers
import os
import reprlib
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import partial

import torch
from tqdm.auto import tqdm

from ..models.gpt import GPT
from ..prompt_mask import check_prompt_mask
from .cache import KERNELS, DenseKVCache, default_kernel
from .sampling import guide, row_key, sample

# torch.compile modes for the blocks (the step is captured in our own CUDA graphs, so none of
# the modes that capture graphs themselves)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def resolve_device(device) -> torch.device:
    """``device``, or CUDA when there is one and the CPU otherwise; a clear error for a device that is not
    ``cpu``, ``cuda`` or ``cuda:N`` or not on this machine."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine; use cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return d


#: Compiled programs each compiled function may hold. Every batch bucket, policy and model shape is a
#: program of its own of the same functions (the block halves, the sampling, a scored cache's
#: bookkeeping); at torch's default of 8 a process that benches 4 batches of 3 policies would meet the
#: 9th as an error (the blocks: ``fullgraph``) or, silently, as eager kernels (the sampling).
RECOMPILE_LIMIT = 256


def recompile_limit_name() -> str:
    """The name of that limit in ``torch._dynamo.config`` (``cache_size_limit`` before torch 2.6)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise torch's per-function limit of compiled programs to at least ``limit``."""
    cfg, name = torch._dynamo.config, recompile_limit_name()
    setattr(cfg, name, max(getattr(cfg, name), limit))


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


def _triton_runs_on(device: torch.device) -> bool:
    """Triton kernels can run on ``device``: CUDA, or the CPU in the interpreter (tests); triton installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def bucket(n: int) -> int:
    """Batch bucket for graph capture: powers of two up to 256, then multiples of 64."""
    if n <= 256:
        return 1 << (n - 1).bit_length()
    return -(-n // 64) * 64


def _per_row(name: str, value, n: int, kind=float) -> list:
    """``value`` (a scalar or one per image) -> ``n`` values of ``kind``: floats finite, ints whole numbers."""
    vals = list(value) if isinstance(value, (Sequence, torch.Tensor)) and not isinstance(value, str) else [value] * n
    if len(vals) != n:
        raise ValueError(f"{name} has {len(vals)} values for {n} images")
    try:
        out = [float(v) for v in vals]
    except (TypeError, ValueError, RuntimeError, OverflowError):
        out = None
    if out is None or any(isinstance(v, (str, bool)) or not math.isfinite(f) for v, f in zip(vals, out)):
        raise ValueError(f"{name} must be a finite {'integer' if kind is int else 'number'} (or one per image), "
                         f"got {reprlib.repr(value)}")
    if kind is int:
        if any(not f.is_integer() for f in out):
            raise ValueError(f"{name} must be a whole number (or one per image), got {reprlib.repr(value)}")
        return [int(v) for v in vals]
    return out


def sampling_rows(B: int, cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0, cfg_interval=-1) -> dict[str, list]:
    """Sampling arguments (scalars or one value per image) -> checked lists of ``B`` values each."""
    rows = dict(cfg_scale=_per_row("cfg_scale", cfg_scale, B), temperature=_per_row("temperature", temperature, B),
                top_k=_per_row("top_k", top_k, B, int), top_p=_per_row("top_p", top_p, B),
                cfg_interval=_per_row("cfg_interval", cfg_interval, B, int))
    if any(c < 0 for c in rows["cfg_scale"]):
        raise ValueError(f"cfg_scale must be >= 0 (1 = no guidance), got {rows['cfg_scale']}")
    if any(t < 0 for t in rows["temperature"]):
        raise ValueError(f"temperature must be >= 0, got {rows['temperature']}")
    if any(k < 0 for k in rows["top_k"]):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {rows['top_k']}")
    if any(not 0.0 < p <= 1.0 for p in rows["top_p"]):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {rows['top_p']}")
    if any(i < -1 for i in rows["cfg_interval"]):
        raise ValueError(f"cfg_interval must be >= -1 (-1 = always), got {rows['cfg_interval']}")
    return rows


def row_keys(seed, B: int) -> list[int]:
    """Noise keys of B images: an int seed gives image i the key (seed, i); a list, (seed[i], 0)."""
    if isinstance(seed, Sequence):
        return [row_key(s, 0) for s in _per_row("seed", seed, B, int)]
    s = _per_row("seed", [seed], 1, int)[0]
    return [row_key(s, i) for i in range(B)]


@dataclass(frozen=True)
class _Plan:
    """What fixes the shape of the captured step: batch bucket, guidance on/off, static top-k bound, top-p on/off,
    caption masks on/off (the masked step reads the mask buffers; the unmasked one nothing extra)."""

    batch: int
    cfg: bool
    kmax: int
    top_p: bool
    masked: bool = False


def step_buffers(b: int, N: int, device) -> dict[str, torch.Tensor]:
    """A runner's per-image buffers for ``b`` images: last sampled token, output (b, N), and the
    sampling arguments (as ``Generator.prepare`` fills them)."""
    z = dict(device=device)
    return dict(cur=torch.zeros(b, dtype=torch.long, **z), out=torch.zeros(b, N, dtype=torch.long, **z),
                keys=torch.zeros(b, dtype=torch.long, **z), temperature=torch.ones(b, **z),
                top_k=torch.zeros(b, dtype=torch.long, **z), top_p=torch.ones(b, **z), cfg_scale=torch.ones(b, **z),
                cfg_interval=torch.full((b,), -1, dtype=torch.long, **z))


class _Stepping:
    """What drives a runner: ``start`` (prefill and the first token), ``decode_step``, ``graph``, ``out``."""

    def advance(self) -> None:
        """One decode step (the captured graph when there is one)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.decode_step()

    def run(self, cond: torch.Tensor, progress: bool) -> torch.Tensor:
        self.start(cond)
        for _ in tqdm(range(self.N - 1), disable=not progress, desc="decode", unit="tok", leave=False):
            self.advance()
        return self.out


class _Runner(_Stepping):
    """Static buffers and the prefill/decode steps for one plan (``buffers``: views to use instead of
    its own, as :func:`step_buffers` makes them)."""

    def __init__(self, gpt: GPT, plan: _Plan, device: torch.device, use_graphs: bool, kernel: str = "torch",
                 compile_step: bool = False, policy=None, buffers: dict | None = None):
        cfg = gpt.config
        self.gpt, self.plan, self.P, self.N = gpt, plan, cfg.cls_token_num, cfg.image_tokens
        b = plan.batch
        rows = 2 * b if plan.cfg else b  # guidance rows are separate sequences to a policy
        if policy is None:
            self.cache = DenseKVCache(cfg, rows, gpt.dtype, device, kernel=kernel)
        else:
            self.cache = policy.make_cache(cfg, rows, gpt.dtype, device, kernel=kernel)
        for name, t in (buffers or step_buffers(b, self.N, device)).items():
            setattr(self, name, t)  # cur (b,), out (b, N), keys, temperature, top_k, top_p, cfg_scale, cfg_interval
        self.graph = None
        if plan.masked:  # the mask buffers exist before the step is captured; set_prompt_mask refills them
            self.cache.set_prompt_mask(torch.ones(rows, self.P, dtype=torch.bool, device=device))
        if compile_step:  # the sampling's many element-wise ops as a few kernels (the blocks: GPT.fuse)
            self._sample = torch.compile(self._sample, dynamic=False)
            if hasattr(self.cache, "fuse"):  # e.g. a scored policy's score/evict bookkeeping
                self.cache.fuse(partial(torch.compile, dynamic=False))
        if use_graphs:
            self._capture()

    def _sample(self, logits: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        p = self.plan
        if p.cfg:
            # LlamaGen's cfg_interval: guidance for the first token and the next cfg_interval + 1.
            active = (self.cfg_interval < 0) | (step <= self.cfg_interval + 1)
            logits = guide(logits, self.cfg_scale, active)
        return sample(logits, self.keys, step, self.temperature,
                      self.top_k if p.kmax else None, self.top_p if p.top_p else None, p.kmax)

    def set_prompt_mask(self, mask: torch.Tensor | None) -> None:
        """Caption masks (b, P) bool of the plan's batch (checked), or None; the guidance rows get the
        same mask as their conditional rows, as in LlamaGen."""
        if (mask is not None) != self.plan.masked:
            raise ValueError(f"this runner was planned {'with' if self.plan.masked else 'without'} caption masks")
        if mask is not None and self.plan.cfg:
            mask = torch.cat([mask, mask])
        self.cache.set_prompt_mask(mask)

    def prefill_logits(self, cond: torch.Tensor) -> torch.Tensor:
        """Run the condition (guidance rows appended) through the model -> next-token logits (R, V).

        Caption masks: set beforehand (:meth:`set_prompt_mask`)."""
        gpt, cache = self.gpt, self.cache
        if self.plan.cfg:
            cond = torch.cat([cond, gpt.null_cond(cond)])
        cache.phase = "prefill"
        h = gpt.embed_cond(cond)  # (R, P, dim)
        logits = gpt.next_logits(h, torch.arange(self.P, device=h.device), cache)
        cache.pos.fill_(self.P)
        cache.phase = "decode"
        return logits

    def step_logits(self) -> torch.Tensor:
        """Feed ``cur`` at ``cache.pos`` and advance; -> next-token logits (R, V). All on the device."""
        gpt, cache = self.gpt, self.cache
        x = torch.cat([self.cur, self.cur]) if self.plan.cfg else self.cur
        h = gpt.tok_embeddings(x[:, None])  # (R, 1, dim)
        logits = gpt.next_logits(h, cache.pos.view(1), cache)
        cache.pos.add_(1)
        return logits

    def _emit(self, logits: torch.Tensor, step: torch.Tensor) -> None:
        tok = self._sample(logits, step)
        self.cur.copy_(tok)
        self.out.index_copy_(1, step.view(1), tok[:, None])

    def decode_step(self) -> None:
        step = self.cache.pos - (self.P - 1)  # index of the token being sampled
        self._emit(self.step_logits(), step)

    @property
    def rows(self) -> int:
        """Sequences in the cache (guidance rows included)."""
        return self.cache.rows

    def warm_up(self) -> None:
        """A few eager decode steps on a side stream: what the step touches is initialised before capture."""
        self.cache.phase = "decode"
        self.cache.pos.fill_(self.P)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.decode_step()
        torch.cuda.current_stream().wait_stream(stream)

    def _capture(self) -> None:
        self.warm_up()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.decode_step()

    def start(self, cond: torch.Tensor) -> None:
        """Prefill ``cond`` and sample the first token of every image."""
        self._emit(self.prefill_logits(cond), torch.zeros((), dtype=torch.long, device=cond.device))


class Generator:
    """Sample image tokens (and images) from a GPT.

    Parameters
    ----------
    gpt : GPT
        The model; moved to ``device`` and cast to ``dtype`` in place.
    tokenizer : ImageTokenizer, optional
        Needed by :meth:`generate` to turn tokens into pixels.
    device : str or torch.device, optional
        Defaults to CUDA when available, else CPU.
    dtype : torch.dtype or {"bf16", "fp16", "fp32"}, optional
        Defaults to bf16 on CUDA, fp32 on CPU.
    cuda_graphs : bool, optional
        Capture the decode step in a CUDA graph per batch bucket (default: on for CUDA).
    kernel : {"torch", "triton"}, optional
        Decode attention implementation (default: Triton on CUDA when installed).
    compile : bool or str, optional
        ``torch.compile`` the two halves of a transformer block (once, shared by every layer:
        :meth:`GPT.fuse`) and the sampling, before the step is captured; attention stays on
        ``kernel``. Fewer, fused kernels per step: what batch 1 needs (default: off). A string is
        the compile mode of the blocks, one of :data:`COMPILE_MODES` (``True`` is ``"default"``;
        ``"max-autotune-no-cudagraphs"`` also tries Triton matmuls with the element-wise work fused in).
    compile_dynamic : bool, optional
        Compile the blocks for any number of rows (symbolic batch sizes) rather than one program
        per shape: for continuous batching, whose steps and prefills come in many sizes (the
        server's ``--compile``). The fixed-batch engine keeps static shapes (default: off).
    policy : str or Policy, optional
        Sparse-attention policy (see ``arsparse policies``); default dense.
    matvec : bool, optional
        Decode steps of at most 16 rows (batch 8 with guidance) through Triton matrix-vector kernels
        with RMSNorm, RoPE, SwiGLU and the residual adds folded in: five launches per block
        (:mod:`arsparse.models.matvec_blocks`; latency mode); on a GPU the sampling is compiled. Not
        with ``compile``; CUDA, or the CPU under ``TRITON_INTERPRET=1`` (default: off).
    streams : {1, 2}, optional
        2: a batch of at least two images runs as two half batches, each its own cache and step, captured
        into one CUDA graph on two streams, so that one half's attention can run beside the other's
        matrix products (:mod:`arsparse.engine.split`; the same images up to float rounding). Default 1.
    """

    def __init__(self, gpt: GPT, tokenizer=None, device=None, dtype=None, cuda_graphs: bool | None = None,
                 kernel: str | None = None, compile: bool | str = False, policy=None, compile_dynamic: bool = False,
                 matvec: bool = False, streams: int = 1):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.gpt = gpt.to(device=self.device, dtype=self.dtype).eval()
        self.gpt.rope = self.gpt.rope.float()  # the RoPE table stays fp32
        self.tokenizer = tokenizer.to(self.device) if tokenizer is not None and hasattr(tokenizer, "to") else tokenizer
        tok_vocab = getattr(tokenizer, "vocab_size", None)
        if tok_vocab is not None and tok_vocab < gpt.config.vocab_size:
            raise ValueError(f"the tokenizer decodes {tok_vocab} token ids but the GPT samples from {gpt.config.vocab_size}: "
                             "they do not belong together")
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA device")
        mode = "default" if compile is True else compile or None
        if mode is not None and mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {compile!r}; choose one of {', '.join(COMPILE_MODES)} "
                             f"(or True / False)")
        self.compile = mode is not None
        if matvec and (self.compile or not _triton_runs_on(self.device)):
            raise ValueError("matvec=True takes neither compile nor a device Triton cannot run on (CUDA, or the CPU "
                             f"under TRITON_INTERPRET=1); got compile={compile!r}, device {self.device}")
        # the sampling compiled too: with the blocks, or beside the matvec blocks on a GPU
        self._compile_step = self.compile or (matvec and self.device.type == "cuda")
        if self._compile_step:
            allow_recompiles()
        if self.compile:
            self.gpt.fuse(partial(torch.compile, dynamic=bool(compile_dynamic), fullgraph=True, mode=mode))
        elif matvec:
            from ..models.matvec_blocks import halves

            self.gpt.fuse(None, halves=halves())
        else:
            self.gpt.unfuse()
        from ..policies import resolve

        self.policy = resolve(policy)
        if self.policy is not None:
            self.policy = self.policy.prepare(self.gpt)
            self.policy.check(gpt.layout)
        self.kernel = kernel or default_kernel(self.device)
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}; choose one of {KERNELS}")
        if self.kernel == "triton" and not _triton_runs_on(self.device):
            raise ValueError(f"kernel 'triton' runs on CUDA with triton installed (the CPU only under "
                             f"TRITON_INTERPRET=1, for tests); on {self.device} use kernel 'torch'")
        if streams not in (1, 2):
            raise ValueError(f"streams must be 1 or 2, got {streams!r}")
        self.streams = streams
        self._runner: _Runner | None = None

    @property
    def config(self):
        return self.gpt.config

    def as_cond(self, cond) -> torch.Tensor:
        """Class labels (ints) or caption features -> a checked tensor on the device."""
        cfg = self.config
        # (a dict or a set has no order, and booleans are no labels or features: refused, not converted)
        unordered = isinstance(cond, (str, bytes, Mapping, AbstractSet))
        dtype = getattr(cond, "dtype", None)  # a tensor's or an array's
        boolean = dtype == torch.bool or getattr(dtype, "kind", None) == "b"
        if cfg.model_type == "c2i":
            if isinstance(cond, torch.Tensor) and not cond.is_floating_point() and not boolean:
                cond = cond.long()
            else:  # (a label like 1.5 or "3" is an error, not truncated or parsed)
                try:
                    labels = [cond] if isinstance(cond, numbers.Integral) else None if unordered or boolean else list(cond)
                except TypeError:
                    labels = None
                if labels is None:
                    raise ValueError(f"class labels must be an int or a sequence of ints (or an integer tensor; not a "
                                     f"dict, a set or booleans), got {reprlib.repr(cond)}")
                cond = torch.tensor(_per_row("class labels", labels, len(labels), int), dtype=torch.long)
        else:
            what = (f"caption features must be a (B, {cfg.cls_token_num}, {cfg.caption_dim}) float tensor or array, "
                    f"got {reprlib.repr(cond)}")
            if unordered or boolean or isinstance(cond, torch.Tensor) and not cond.is_floating_point():
                raise ValueError(what)
            try:
                cond = torch.as_tensor(cond, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(what) from None
        self.gpt.check_cond(cond)
        return cond.to(self.device, non_blocking=True)  # from pageable memory: staged at once, no stream sync

    def release(self) -> None:
        """Free the captured step and its cache now (a compiled runner sits in a reference cycle,
        which plain ``del`` leaves to the garbage collector)."""
        self._runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _runner_for(self, plan: _Plan) -> _Runner:
        if self._runner is None or self._runner.plan != plan:
            self.release()  # free the old cache before allocating the new one
            kind = _Runner
            if self.streams == 2 and plan.batch >= 2:
                from .split import SplitRunner as kind
            self._runner = kind(self.gpt, plan, self.device, self.cuda_graphs, self.kernel, self._compile_step,
                                self.policy)
        return self._runner

    @torch.no_grad()
    def sample_tokens(self, cond, cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                      cfg_interval=-1, progress: bool = False, prompt_mask=None) -> torch.LongTensor:
        """Sample (B, N) image tokens for B conditions.

        Every sampling argument is a scalar or one value per image. ``seed`` is an int (image i of the
        call uses key (seed, i)) or a list of ints (image i uses (seed[i], 0)), so an image depends on
        its own seed only, never on the rest of the batch. ``top_k=1`` or ``temperature=0`` is greedy;
        ``top_k=0`` and ``top_p=1`` turn those filters off; ``cfg_scale=1`` turns guidance off;
        ``cfg_interval=-1`` guides every token (else, as LlamaGen, the first ``cfg_interval + 2``).
        ``prompt_mask`` (t2i): (B, P) bool, True at real caption tokens (LlamaGen's ``emb_masks``,
        left padding by default; see :mod:`arsparse.prompt_mask`); the unconditional rows of guidance
        use the same mask, as in LlamaGen.
        """
        run, cond, B = self.prepare(cond, cfg_scale, temperature, top_k, top_p, seed, cfg_interval, prompt_mask)
        return run.run(cond, progress)[:B].clone()

    @torch.no_grad()
    def prepare(self, cond, cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0, seed=0, cfg_interval=-1,
                prompt_mask=None):
        """Check the arguments, pick (or capture) the runner, fill its buffers (the caption masks too).

        Returns ``(runner, cond padded to the batch bucket, number of real images)``.
        """
        cond = self.as_cond(cond)
        B = cond.shape[0]
        if B == 0:
            raise ValueError("no conditions given")
        mask = check_prompt_mask(prompt_mask, B, self.config.cls_token_num, self.config.model_type)
        rows = sampling_rows(B, cfg_scale, temperature, top_k, top_p, cfg_interval)
        scale, temp, ks, ps, intervals = (rows[k] for k in ("cfg_scale", "temperature", "top_k", "top_p", "cfg_interval"))
        keys = row_keys(seed, B)

        use_cfg = any(s != 1.0 for s in scale)
        kmax = min(max(ks), self.config.vocab_size)
        b = bucket(B) if self.cuda_graphs else B
        run = self._runner_for(_Plan(b, use_cfg, kmax, any(p < 1.0 for p in ps), mask is not None))

        pad = b - B

        def fill(buf, vals, dtype):
            buf.copy_(torch.tensor(vals + vals[-1:] * pad, dtype=dtype), non_blocking=True)  # no stream sync

        fill(run.keys, keys, torch.long)
        fill(run.temperature, temp, torch.float32)
        fill(run.top_k, ks, torch.long)
        fill(run.top_p, ps, torch.float32)
        fill(run.cfg_scale, scale, torch.float32)
        fill(run.cfg_interval, intervals, torch.long)
        if pad:
            cond = torch.cat([cond, cond[-1:].expand(pad, *cond.shape[1:])])
        if mask is not None:
            mask = mask.to(self.device, non_blocking=True)
            run.set_prompt_mask(torch.cat([mask, mask[-1:].expand(pad, -1)]) if pad else mask)
        return run, cond, B

    @torch.no_grad()
    def cached_logits(self, cond, tokens: torch.Tensor, prompt_mask=None) -> torch.Tensor:
        """Teacher forcing through the decode path: logits (B, T, V) of the cache, step by step.

        Equals ``gpt.logits(cond, tokens, policy=self.policy, prompt_mask=prompt_mask)`` up to float
        rounding; no guidance, no sampling.
        """
        cond = torch.as_tensor(cond).to(self.device)
        self.gpt.check_cond(cond, allow_null=True)
        self.gpt.check_tokens(tokens, cond.shape[0])  # (the steps would broadcast, index past the cache or the vocabulary)
        mask = check_prompt_mask(prompt_mask, cond.shape[0], self.config.cls_token_num, self.config.model_type)
        tokens = tokens.to(self.device)
        run = _Runner(self.gpt, _Plan(cond.shape[0], False, 0, False, mask is not None), self.device, False,
                      self.kernel, policy=self.policy)
        run.set_prompt_mask(None if mask is None else mask.to(self.device))
        out = [run.prefill_logits(cond)]
        for t in range(1, tokens.shape[1]):
            run.cur.copy_(tokens[:, t - 1])
            out.append(run.step_logits())
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def decode_images(self, tokens: torch.Tensor, chunk: int = 16, host: bool = True,
                      check_range: bool = True) -> torch.Tensor:
        """(B, N) tokens -> (B, 3, H, W) fp32 images in [-1, 1] through the tokenizer, ``chunk`` at a time;
        on the CPU, or on the device when ``host`` is False. ``check_range=False`` skips the check that
        the ids are in the tokenizer's range, which waits for the device: for tokens this generator
        sampled (in range: the tokenizer covers the GPT's vocabulary), so that nothing waits."""
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer: pass tokenizer=... to turn tokens into images")
        grid = (self.config.grid_h, self.config.grid_w)
        parts = []
        for i in range(0, max(tokens.shape[0], 1), chunk):  # (no tokens: one empty chunk, (0, 3, H, W) images)
            images = self.tokenizer.decode(tokens[i : i + chunk].to(self.device, non_blocking=True), grid=grid,
                                           check_range=check_range).float()
            parts.append(images.cpu() if host else images)
        return torch.cat(parts)

    def generate(self, cond, progress: bool = False, **sampling) -> list:
        """Like :meth:`sample_tokens`, then decoded to a list of PIL images."""
        from ..tokenizers import to_pil

        return to_pil(self.decode_images(self.sample_tokens(cond, progress=progress, **sampling)))
