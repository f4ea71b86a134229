"""Request scheduling: a queue, admission by KV memory, and one decode loop per policy.

Each policy (name + parameters) the server runs has a :class:`Scheduler` (see
:mod:`arsparse.serve.pool` for how they are created and kept): a worker thread that
owns a pool of image slots sized from a KV memory budget, a bounded queue in front of it, and
the decode loop. Between two decode steps the worker drops requests that timed out or whose
client went away (their slots are freed at once), admits waiting requests in arrival order while
their images fit in the free slots, then runs one step. Every request's future is resolved
exactly once, by the worker, with its own tokens (rows are never shared between requests).

The worker never waits on the device while there is work: requests that finish on the same step
are decoded to images in one batch, copied to host memory asynchronously, and answered once the
copy is done (checked between steps). Where its time goes is in ``stats()["worker"]``
(:class:`WorkerClock`).

Two modes:

* :class:`ContinuousScheduler` (dense and offset policies): true continuous batching over a
  :class:`~arsparse.engine.continuous.SlotDecoder`; a request joins the running batch at the next
  step boundary and leaves it the step it finishes.
* :class:`CohortScheduler` (scored policies, whose caches assume one shared position): requests
  that are waiting when a batch starts run together through the fixed-batch engine
  (``Generator.prepare``); later arrivals wait for the next batch.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..engine.continuous import SlotDecoder, to_device
from ..engine.generator import Generator

log = logging.getLogger("arsparse.serve")
_ids = itertools.count(1)


class ServeError(Exception):
    """A request the server will not (or can no longer) answer with images: an HTTP status and why."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass(eq=False)
class Job:
    """One generation request: ``n`` images of one condition and one set of sampling arguments.

    ``cond``: (n,) class labels or (n, P, C) caption features; ``keys``: the noise key of each
    image; ``rows``: per-image sampling arguments (``sampling_rows``); ``deadline``: on the
    ``time.monotonic`` clock; ``prompt_mask``: (n, P) bool caption mask (t2i, padded captions) or None.
    """

    cond: torch.Tensor
    keys: list[int]
    rows: dict[str, list]
    deadline: float
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    cancelled: bool = False
    prompt_mask: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.keys)

    @property
    def group(self) -> tuple[bool, bool]:
        """What a fixed batch must agree on to give each image what it gets alone: guidance on, top-p on."""
        return any(c != 1.0 for c in self.rows["cfg_scale"]), any(p < 1.0 for p in self.rows["top_p"])

    def stop_reason(self, now: float) -> ServeError | None:
        if self.cancelled:
            return ServeError(499, "the client went away")
        if now > self.deadline:
            return ServeError(504, f"request timed out after {now - self.submitted:.1f} s "
                                   "(set timeout_s to allow longer, or retry when the server is less busy)")
        return None


def _masks(jobs: list[Job]) -> torch.Tensor | None:
    """The caption masks of ``jobs`` stacked (k, P), unpadded ones all True; None when none is padded."""
    if all(job.prompt_mask is None for job in jobs):
        return None
    P = next(job.prompt_mask for job in jobs if job.prompt_mask is not None).shape[1]
    return torch.cat([torch.ones(job.n, P, dtype=torch.bool) if job.prompt_mask is None else job.prompt_mask
                      for job in jobs])


@dataclass
class Result:
    tokens: torch.Tensor  # (n, N) int64, CPU
    images: torch.Tensor  # (n, 3, H, W) in [-1, 1], CPU
    queue_s: float
    run_s: float


class WorkerClock:
    """Where a worker thread's time goes: its life cut into back-to-back segments, each charged to one phase.

    ``step``: launching decode steps (on CUDA the device runs them asynchronously, so this is host
    time: Python, launches, CUDA graph replays); ``device``: waiting for the device to catch up (the
    worker keeps at most ``Scheduler.max_ahead`` steps queued ahead of it); ``admit``: prefilling
    admitted requests; ``finish``: decoding finished requests to images, queuing their copy to the
    host and answering them; ``idle``: waiting for requests; ``other``: the rest (locks, timeouts,
    bookkeeping). The seconds add up to ``worker_s``, the time accounted so far. Only
    ``time.perf_counter`` is read: no device syncs.
    """

    PHASES = ("step", "device", "admit", "finish", "idle", "other")
    COUNTS = ("steps", "admissions", "admitted_requests", "finish_batches", "finished_requests")

    def __init__(self):
        self.start = self.mark = time.perf_counter()
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.counts = dict.fromkeys(self.COUNTS, 0)

    def charge(self, phase: str, **counts: int) -> None:
        """The time since the last charge was spent in ``phase``; ``counts`` are added to the counters."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.mark
        self.mark = now
        for key, n in counts.items():
            self.counts[key] += n

    def snapshot(self) -> dict:
        """Seconds per phase (``step_s`` ...), ``worker_s``, the counters, and per step: ``step_ms`` (host
        time launching one step) and ``busy_ms_per_step`` (all but idle time, per step)."""
        seconds, counts, worker_s = dict(self.seconds), dict(self.counts), self.mark - self.start
        steps = max(1, counts["steps"])
        return {**{f"{p}_s": seconds[p] for p in self.PHASES}, "worker_s": worker_s, **counts,
                "step_ms": 1e3 * seconds["step"] / steps,
                "busy_ms_per_step": 1e3 * (sum(seconds.values()) - seconds["idle"]) / steps}


@dataclass
class _Delivery:
    """Finished requests whose tokens and images are on their way to host memory."""

    jobs: list
    tokens: torch.Tensor  # (sum n, N) int64, host
    images: torch.Tensor  # (sum n, 3, H, W), host
    ready: object  # a CUDA event recorded after the copies, or None (already on the host)


class Scheduler:
    """Queue, admission and the worker thread; subclasses define how images are decoded."""

    mode = ""
    sweep_s = 0.02  # how often the worker looks for requests that timed out or were cancelled
    max_ahead = 4  # CUDA: decode steps queued ahead of the device, at most

    def __init__(self, gen: Generator, slots: int, guidance: bool, row_bytes: int, max_queue: int, name: str):
        self.gen, self.slots, self.guidance, self.max_queue, self.name = gen, slots, guidance, max_queue, name
        self.bytes_per_image = (2 if guidance else 1) * row_bytes
        self.tokens_total = 0
        self.max_running = 0
        self.completed = 0
        self._service_s = 1.0  # running mean of a request's decode time, for Retry-After
        self._rate: deque[tuple[float, int]] = deque()  # (time, tokens_total) over the last few seconds
        self._waiting: deque[Job] = deque()
        self._deliveries: deque[_Delivery] = deque()  # finished, copying to the host (worker thread only)
        self._queued: deque = deque()  # CUDA events recorded after the steps the device may not have run yet
        self._next_sweep = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.clock = WorkerClock()
        self._thread = threading.Thread(target=self._loop, name=f"arsparse-serve-{name}", daemon=True)
        self._thread.start()

    # ---- called from request threads -------------------------------------------------------
    def submit(self, job: Job) -> None:
        if job.n > self.slots:
            raise ServeError(422, f"n={job.n} images do not fit: the server decodes at most {self.slots} "
                                  f"images at once under policy {self.name}")
        with self._wake:
            if self._closed:
                raise ServeError(503, f"policy {self.name} is shutting down; retry", retry_after=1)
            if len(self._waiting) >= self.max_queue:
                raise ServeError(429, f"the queue for policy {self.name} is full ({self.max_queue} requests "
                                      "waiting); retry later", retry_after=self.retry_after())
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Ask the worker to drop ``job`` (its slots are freed at a step boundary within ``sweep_s``)."""
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained enough to take a request: whole seconds, >= 1."""
        queued = sum(j.n for j in list(self._waiting))
        return max(1, math.ceil(self._service_s * (1 + queued / self.slots)))

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._running() and not self._deliveries

    def stats(self) -> dict:
        with self._lock:
            queue = len(self._waiting)
        running = self.running_images()
        return dict(policy=self.name, mode=self.mode, slots=self.slots, queue_length=queue, running_images=running,
                    max_running_images=self.max_running, tokens_total=self.tokens_total,
                    tokens_per_second=self.tokens_per_second(), completed=self.completed,
                    kv_bytes_in_use=running * self.bytes_per_image, kv_bytes_capacity=self.slots * self.bytes_per_image,
                    worker=self.clock.snapshot())

    def tokens_per_second(self, window: float = 5.0) -> float:
        now = time.monotonic()
        pts = [p for p in list(self._rate) if now - p[0] <= window]
        if len(pts) < 2 or pts[-1][0] == pts[0][0]:
            return 0.0
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def close(self) -> None:
        """Stop the worker; waiting and running requests get a 503 (finished ones are still answered)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        self._deliver(wait=True)
        err = ServeError(503, f"policy {self.name} was shut down; retry", retry_after=1)
        for job in list(self._waiting):
            self._fail(job, err)
        self._waiting.clear()
        self._drop_running(err)

    # ---- the worker ---------------------------------------------------------------------
    def _loop(self) -> None:
        clock = self.clock
        with torch.no_grad():
            while True:
                if self._deliveries and not self._waiting and not self._running():
                    self._deliver(wait=True)  # nothing to overlap the copies with
                    clock.charge("finish")
                with self._wake:
                    if not self._closed and not self._waiting and not self._running():
                        clock.charge("other")
                        while not self._closed and not self._waiting and not self._running():
                            self._wake.wait()
                        clock.charge("idle")
                    if self._closed:
                        return
                    now = time.monotonic()
                    sweep = now >= self._next_sweep
                    stopped = []
                    if sweep:  # an O(queue) scan: not every step
                        self._next_sweep = now + self.sweep_s
                        stopped = [(j, e) for j in self._waiting if (e := j.stop_reason(now)) is not None]
                        for job, _ in stopped:
                            self._waiting.remove(job)
                for job, err in stopped:
                    self._fail(job, err)
                try:
                    if sweep:
                        self._reap(now)
                    clock.charge("other")
                    admitted = self._admit()
                    if admitted:
                        clock.charge("admit", admissions=1, admitted_requests=admitted)
                    self.max_running = max(self.max_running, self.running_images())
                    if self._running():
                        self._advance()  # charges step and finish itself
                        self._pace()
                    if self._deliveries:
                        self._deliver()
                        clock.charge("finish")
                except Exception as e:  # an engine failure fails what runs now; the server stays up
                    log.exception("decode failed under policy %s", self.name)
                    self._drop_running(ServeError(500, f"generation failed: {type(e).__name__}: {e}"))
                    clock.charge("other")

    def _pace(self) -> None:
        """On CUDA, wait while more than ``max_ahead`` steps are queued ahead of the device. Without a
        bound the worker would run hundreds of steps ahead (each launch takes far less host time than
        the device takes to run it) until the launch queue is full, and its view of which requests are
        done would run ahead of the device as far; waiting on an event also leaves the GIL to the HTTP
        threads, which a launch blocked on a full queue may not."""
        if self.gen.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        self._queued.append(event)
        if len(self._queued) > self.max_ahead:
            self._queued.popleft().synchronize()
        self.clock.charge("device")

    def _take_fitting(self, free: int, group=None) -> list[Job]:
        """Waiting jobs to start now: in arrival order while they fit in ``free`` slots (and are of ``group``)."""
        taken = []
        with self._lock:
            while self._waiting:
                job = self._waiting[0]
                if job.n > free or (group is not None and job.group != group):
                    break
                taken.append(self._waiting.popleft())
                free -= job.n
        return taken

    def _count(self, tokens: int) -> None:
        self.tokens_total += tokens
        now = time.monotonic()
        self._rate.append((now, self.tokens_total))
        while self._rate and now - self._rate[0][0] > 10.0:
            self._rate.popleft()

    def _finish(self, jobs: list[Job], tokens: torch.Tensor) -> None:
        """``jobs`` are done; ``tokens`` (sum n, N) their tokens in order, on the device. Their images are
        decoded in one batch and copied to the host without waiting; :meth:`_deliver` answers them."""
        try:
            # One batch on a GPU; one image at a time on the CPU, where a batch only spills the caches.
            chunk = 16 if tokens.device.type == "cuda" else 1
            images = self.gen.decode_images(tokens, chunk=chunk, host=False, check_range=False)  # (sum n, 3, H, W)
            if tokens.device.type == "cuda":
                tokens, images, ready = _to_host(tokens), _to_host(images), torch.cuda.Event()
                ready.record()
            else:
                tokens, images, ready = tokens.cpu(), images.cpu(), None
        except Exception as e:
            for job in jobs:
                self._fail(job, ServeError(500, f"decoding images failed: {type(e).__name__}: {e}"))
            return
        self._deliveries.append(_Delivery(jobs, tokens, images, ready))
        self.clock.charge("finish", finish_batches=1)

    def _deliver(self, wait: bool = False) -> None:
        """Answer the finished requests whose copies to the host are done (``wait``: all of them)."""
        while self._deliveries:
            d = self._deliveries[0]
            if d.ready is not None:
                if not wait and not d.ready.query():
                    return
                d.ready.synchronize()
            self._deliveries.popleft()
            now, first = time.monotonic(), 0
            for job in d.jobs:
                run_s = now - (job.started or now)
                self._service_s = 0.8 * self._service_s + 0.2 * run_s
                self.completed += 1
                if not job.future.done():
                    rows = slice(first, first + job.n)
                    job.future.set_result(Result(d.tokens[rows], d.images[rows],
                                                 queue_s=(job.started or now) - job.submitted, run_s=run_s))
                first += job.n
            self.clock.counts["finished_requests"] += len(d.jobs)

    @staticmethod
    def _fail(job: Job, err: ServeError) -> None:
        if not job.future.done():
            job.future.set_exception(err)

    # ---- what a mode defines ------------------------------------------------------------
    def _running(self) -> bool:
        raise NotImplementedError

    def running_images(self) -> int:
        raise NotImplementedError

    def _reap(self, now: float) -> None:
        """Drop running jobs that were cancelled or timed out."""
        raise NotImplementedError

    def _admit(self) -> int:
        """Start waiting jobs that fit; -> how many."""
        raise NotImplementedError

    def _advance(self) -> None:
        """One step; charges the clock's ``step`` (and ``finish`` for requests that completed)."""
        raise NotImplementedError

    def _drop_running(self, err: ServeError) -> None:
        raise NotImplementedError


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor ``x``, queued on the current stream (valid once it has run)."""
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    out.copy_(x, non_blocking=True)
    return out


class ContinuousScheduler(Scheduler):
    """Continuous batching: requests join and leave the running batch at every step boundary."""

    mode = "continuous"

    def __init__(self, gen: Generator, slots: int, guidance: bool, row_bytes: int, max_queue: int, name: str,
                 cuda_graphs: bool = False):
        self.decoder = SlotDecoder(gen, slots, guidance, cuda_graphs=cuda_graphs)
        self._jobs: dict[Job, list[int]] = {}  # running job -> its slots
        self._owner: dict[int, Job] = {}  # busy slot -> its job
        super().__init__(gen, slots, guidance, row_bytes, max_queue, name)

    def _running(self) -> bool:
        return bool(self._jobs)

    def running_images(self) -> int:
        return self.decoder.busy()  # a running job's images hold one slot each

    def _release(self, job: Job) -> None:
        slots = self._jobs.pop(job)
        for s in slots:
            del self._owner[s]
        self.decoder.release(slots)

    def _reap(self, now: float) -> None:
        for job in list(self._jobs):
            err = job.stop_reason(now)
            if err is not None:
                self._release(job)
                self._fail(job, err)

    def _admit(self) -> int:
        if not self._waiting:
            return 0
        jobs = self._take_fitting(self.decoder.free_count())
        if not jobs:
            return 0
        free, slots, start = self.decoder.free_slots(), [], time.monotonic()
        for job in jobs:
            self._jobs[job], free = free[: job.n], free[job.n :]
            for s in self._jobs[job]:
                self._owner[s] = job
            slots += self._jobs[job]
            job.started = start
        rows = {k: [v for job in jobs for v in job.rows[k]] for k in jobs[0].rows}
        try:
            self.decoder.admit(slots, torch.cat([job.cond for job in jobs]), [k for job in jobs for k in job.keys], rows,
                               prompt_mask=_masks(jobs))
        except Exception as e:  # fails these requests only: the running slots are untouched
            log.exception("prefill failed under policy %s", self.name)
            for job in jobs:
                self._release(job)
                self._fail(job, ServeError(500, f"prefill failed: {type(e).__name__}: {e}"))
            return 0
        self._count(len(slots))
        return len(jobs)

    def _advance(self) -> None:
        self._count(self.decoder.step())
        self.clock.charge("step", steps=1)
        done = self.decoder.done()
        if not done:
            return
        done_set = set(done)
        # A job's images join together, so they finish on the same step.
        finished = list(dict.fromkeys(self._owner[s] for s in done))
        finished = [job for job in finished if all(s in done_set for s in self._jobs[job])]
        if not finished:
            return
        tokens = self.decoder.tokens([s for job in finished for s in self._jobs[job]])
        for job in finished:
            self._release(job)
        self._finish(finished, tokens)

    def _drop_running(self, err: ServeError) -> None:
        for job in list(self._jobs):
            self._release(job)
            self._fail(job, err)


@dataclass
class _Cohort:
    run: object  # the engine's runner for this batch
    B: int
    jobs: dict  # live job -> first row
    steps_left: int


class CohortScheduler(Scheduler):
    """Batches of the requests waiting when a batch starts, through the fixed-batch engine.

    For policies whose cache assumes one position for the whole batch (scored policies). A batch
    takes waiting requests in arrival order that agree on guidance on/off and top-p on/off (so
    that each image gets exactly what it would alone); a dropped request's rows keep decoding
    until the batch ends, but its answer is sent at once.
    """

    mode = "cohort"

    def __init__(self, gen: Generator, slots: int, guidance: bool, row_bytes: int, max_queue: int, name: str):
        self._cohort: _Cohort | None = None
        super().__init__(gen, slots, guidance, row_bytes, max_queue, name)

    def _running(self) -> bool:
        return self._cohort is not None

    def running_images(self) -> int:
        c = self._cohort
        return sum(job.n for job in list(c.jobs)) if c is not None else 0

    def _reap(self, now: float) -> None:
        c = self._cohort
        if c is None:
            return
        for job in list(c.jobs):
            err = job.stop_reason(now)
            if err is not None:
                del c.jobs[job]
                self._fail(job, err)
        if not c.jobs:
            self._cohort = None

    def _admit(self) -> int:
        if self._cohort is not None:
            return 0
        with self._lock:
            group = self._waiting[0].group if self._waiting else None
        jobs = self._take_fitting(self.slots, group)
        if not jobs:
            return 0
        rows = {k: [v for job in jobs for v in job.rows[k]] for k in jobs[0].rows}
        start = time.monotonic()
        try:
            run, cond, B = self.gen.prepare(torch.cat([job.cond for job in jobs]), seed=0, prompt_mask=_masks(jobs),
                                            **rows)
            run.keys[:B] = to_device([k for job in jobs for k in job.keys], run.keys.device)
            run.start(cond)
        except Exception as e:
            log.exception("prefill failed under policy %s", self.name)
            for job in jobs:
                self._fail(job, ServeError(500, f"prefill failed: {type(e).__name__}: {e}"))
            return 0
        first = itertools.accumulate([0] + [job.n for job in jobs])
        self._cohort = _Cohort(run, B, dict(zip(jobs, first)), steps_left=self.gen.config.image_tokens - 1)
        for job in jobs:
            job.started = start
        self._count(B)
        return len(jobs)

    def _advance(self) -> None:
        c = self._cohort
        if c.steps_left:
            c.run.advance()
            c.steps_left -= 1
            self._count(self.running_images())
        self.clock.charge("step", steps=1)
        if c.steps_left == 0:
            self._cohort = None
            jobs = list(c.jobs)
            if jobs:
                rows = torch.cat([torch.arange(first, first + job.n) for job, first in c.jobs.items()])
                self._finish(jobs, c.run.out[to_device(rows, c.run.out.device)])

    def _drop_running(self, err: ServeError) -> None:
        c, self._cohort = self._cohort, None
        for job in list(c.jobs) if c is not None else []:
            self._fail(job, err)
