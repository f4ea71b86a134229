"""The live schedulers of a server: one per policy (name + parameters), created on first use."""
from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import MISSING, fields

import torch

from ..engine.continuous import make_row_cache, supports_continuous
from ..engine.generator import Generator
from ..policies import PolicyError, get
from .scheduler import CohortScheduler, ContinuousScheduler, Job, Scheduler, ServeError

log = logging.getLogger("arsparse.serve")


def _check_arg_sizes(args: dict, limit: int) -> None:
    """Numeric policy parameters within +-limit (no parameter means more than the sequence length)."""
    for key, value in args.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                math.isfinite(value) and -limit <= value <= limit):
            raise PolicyError(f"policy_args.{key}={value!r} is out of range: numeric policy parameters must be "
                              f"within +-{limit} (the model's sequence length)")


class SchedulerPool:
    """The live schedulers, one per policy (name + parameters), created on first use.

    The server's own policy is created at start and never closed. At most ``max_policies`` are
    live; to make room for a new one the least recently used idle one is closed (its slot pool
    freed), and when none is idle the request gets a 429.
    """

    def __init__(self, gpt, tokenizer, config, device=None, dtype=None, policy: str = "dense",
                 policy_args: dict | None = None):
        self.gpt, self.tokenizer, self.config, self.device, self.dtype = gpt, tokenizer, config, device, dtype
        self._lock = threading.Lock()  # guards _live
        self._create_lock = threading.Lock()
        self._live: OrderedDict[tuple, Scheduler] = OrderedDict()
        self.default_name, self.default_args = policy, dict(policy_args or {})
        self.default_key = self._key(policy, self.default_args)
        with self._lock:
            self._live[self.default_key] = self._create(get(policy, **self.default_args))

    @staticmethod
    def _key(name: str, args: dict) -> tuple[str, str]:
        """(name, all parameters): the same policy however its arguments were spelled."""
        return name, repr(sorted(get(name, **args).params().items(), key=lambda kv: kv[0]))

    def resolve(self, name: str | None, args: dict | None) -> tuple[tuple, dict]:
        """-> (key, arguments) of the policy a request names; PolicyError for a bad one."""
        if name is None and args:
            raise PolicyError(f"policy_args {sorted(args)} given without policy: name the policy they are for "
                              f"(the server's default is {self.default_name!r})")
        if name is None or (name == self.default_name and args is None):
            return self.default_key, self.default_args
        args = dict(args or {})
        _check_arg_sizes(args, self.gpt.config.seq_len)
        try:
            return self._key(name, args), args
        except TypeError as e:  # a parameter of the wrong type that the policy did not check itself
            raise PolicyError(f"{name}: bad parameter type ({e})") from None

    def submit(self, name: str | None, args: dict | None, job: Job) -> Scheduler:
        """Queue ``job`` on the scheduler of its policy, creating it if needed.

        A new scheduler is built outside ``_lock`` (a calibrated policy measures the model first, seconds
        on a GPU), so /health and requests for live policies go on meanwhile; ``_create_lock`` builds one
        at a time, so two requests for the same new policy calibrate it once.
        """
        key, args = self.resolve(name, args)
        with self._lock:
            sched = self._live.get(key)
            if sched is not None:
                return self._queue(key, sched, job)
        with self._create_lock:
            with self._lock:
                sched = self._live.get(key)
                if sched is not None:  # (built by the request before this one)
                    return self._queue(key, sched, job)
            try:
                policy = get(key[0], **args)
                policy.check(self.gpt.layout)  # before closing an idle pool for it
                with self._lock:
                    self._make_room()
                sched = self._create(policy)
            except TypeError as e:
                raise PolicyError(f"{key[0]}: bad parameter type ({e})") from None
            with self._lock:
                self._live[key] = sched
                return self._queue(key, sched, job)

    def _queue(self, key: tuple, sched: Scheduler, job: Job) -> Scheduler:
        self._live.move_to_end(key)
        sched.submit(job)
        return sched

    def _make_room(self) -> None:
        if len(self._live) < self.config.max_policies:
            return
        for key, sched in self._live.items():
            if key != self.default_key and sched.idle():
                del self._live[key]
                sched.close()
                if sched.gen.device.type == "cuda":
                    torch.cuda.empty_cache()
                return
        raise ServeError(429, f"the server runs at most {self.config.max_policies} policies at once and all are "
                              f"busy: {', '.join(s.name for s in self._live.values())}; retry later or use one of them",
                         retry_after=max(s.retry_after() for s in self._live.values()))

    def _create(self, policy) -> Scheduler:
        gen = Generator(self.gpt, self.tokenizer, device=self.device, dtype=self.dtype, cuda_graphs=False,
                        policy=policy, compile=self.config.compile, compile_dynamic=True)
        cfg = gen.config
        guidance = cfg.model_type == "t2i" or cfg.has_null_class
        name = policy_label(policy)
        continuous = supports_continuous(gen.policy)
        if continuous:
            row_bytes = make_row_cache(gen.policy, cfg, 1, gen.gpt.dtype, torch.device("meta")).nbytes()
        else:
            row_bytes = gen.policy.make_cache(cfg, 1, gen.gpt.dtype, torch.device("meta")).nbytes()
        slots = self._slots(gen, guidance, row_bytes, name)
        log.info("policy %s: %s batching, %d slots, %.1f MiB KV per image", name,
                 "continuous" if continuous else "cohort", slots, (2 if guidance else 1) * row_bytes / 2**20)
        if continuous:
            return ContinuousScheduler(gen, slots, guidance, row_bytes, self.config.max_queue, name,
                                       cuda_graphs=self.config.cuda_graphs)
        return CohortScheduler(gen, slots, guidance, row_bytes, self.config.max_queue, name)

    def _slots(self, gen: Generator, guidance: bool, row_bytes: int, name: str) -> int:
        per_image = (2 if guidance else 1) * row_bytes
        cfg = self.config
        if cfg.kv_memory_gb is not None:
            budget = int(cfg.kv_memory_gb * 2**30)
        elif gen.device.type == "cuda":
            from ..engine.throughput import step_workspace_per_sequence

            free = torch.cuda.mem_get_info(gen.device)[0] - (2 << 30)
            budget = free * per_image // (per_image + (2 if guidance else 1) * step_workspace_per_sequence(gen.gpt))
        else:
            return cfg.max_batch
        slots = min(cfg.max_batch, budget // per_image)
        if slots < 1:
            raise ValueError(f"policy {name}: one image needs {per_image / 2**20:.1f} MiB of KV cache, more than "
                             f"the {budget / 2**20:.1f} MiB budget")
        return int(slots)

    def schedulers(self) -> list[Scheduler]:
        with self._lock:
            return list(self._live.values())

    @property
    def default(self) -> Scheduler:
        return self._live[self.default_key]

    def close(self) -> None:
        with self._lock:
            for sched in self._live.values():
                sched.close()
            self._live.clear()


def policy_label(policy) -> str:
    """``diagonal`` or ``diagonal:rows=2,band=1``: the name and the parameters that differ from the defaults."""
    changed = [f"{f.name}={getattr(policy, f.name)}" for f in fields(policy)
               if f.default is MISSING or getattr(policy, f.name) != f.default]
    return policy.name + (":" + ",".join(changed) if changed else "")
