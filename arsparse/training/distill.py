"""On-policy distillation for sparse-aware fine-tuning (``TrainConfig.sparse_loss = "distill"``).

Cross-entropy on the data teaches the sparse read set to predict real images, teacher-forced; but
sampling conditions every step on tokens the sparse model wrote itself, and small per-token errors
compound over hundreds of steps into images that look different (fashion-c2i after the first
fine-tune: NLL within 1 % of dense, MobileNetV2 Fréchet distance 6-10 % above). This objective
trains where sampling goes (on-policy distillation, Agarwal et al. 2024, "On-Policy Distillation
of Language Models: Learning from Self-Generated Mistakes"):

1. a pool of sequences is sampled from the *current* weights under the policy, through the real
   decode path (:class:`~arsparse.engine.generator.Generator`: the policy's ring cache, guidance
   ``cfg_scale``), refreshed whenever the training steps have used it up;
2. on those sequences the student (the trained weights, attention masked to the policy's read sets)
   is pulled towards the frozen *dense* teacher (the weights the run started from) by a KL divergence
   between their *sampling* distributions at every step: the guided ``softmax(u + s (c - u))`` of the
   conditional and null-class logits (``c``, ``u``), as the sampler draws from it.

``divergence="reverse"`` (the default), ``KL(student || teacher)`` per step on the student's own
samples, sums over a sequence to the sequence-level ``KL(student sampler || dense sampler)``, the
divergence between what the two would generate (the gradient through which prefixes get sampled
aside). ``"forward"``, ``KL(teacher || student)``, covers the teacher's modes instead: on fashion-c2i
(forward KL on the conditional and null rows separately, 335 steps) it halved the KL on the
student's samples but raised the student's entropy, and the MobileNetV2 Fréchet gap went from +8 % to
+29 % (BENCHMARKS.md, session 11).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..checkpoint import load_into
from ..models.gpt import GPT

__all__ = ["DIVERGENCES", "OnPolicyDistiller", "kl_divergence"]

DIVERGENCES = ("reverse", "forward")


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, direction: str = "reverse") -> torch.Tensor:
    """Mean over positions of ``KL(student || teacher)`` (``"reverse"``) or ``KL(teacher || student)``
    (``"forward"``) between the softmaxes of ``(..., vocab)`` logits, in nats, computed in fp32; the
    gradient is the student's only."""
    log_p = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    if direction == "forward":
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    if direction == "reverse":
        return (log_q.exp() * (log_q - log_p)).sum(-1).mean()
    raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")


class OnPolicyDistiller:
    """The sampled pool, the frozen teacher and the loss of one distillation run.

    Parameters
    ----------
    model : GPT
        The weights being trained (read when the pool is refreshed; never modified here).
    teacher_state : dict
        The dense teacher's weights (the run's ``init_from``); kept frozen, on ``device``.
    policy : str
        The offset policy the pool is sampled with (the policy the student trains for).
    pool : int
        Sequences sampled per refresh; each training step takes ``batch`` of them.
    batch : int
        Sequences per training step.
    cfg_scale : float
        Guidance the pool is sampled with and the distributions compared are guided by (the model's
        usual; 1: none, the conditional distributions).
    divergence : {"reverse", "forward"}
    device : torch.device
    seed : int
        Image ``i`` of pool ``r`` is sampled with the Generator's seed ``1,000,000,007 (seed + 1) + r pool
        + i``: reproducible, and far from the seeds evaluations use.
    """

    def __init__(self, model: GPT, teacher_state: dict, policy: str, pool: int, batch: int, cfg_scale: float,
                 device: torch.device, seed: int, divergence: str = "reverse"):
        from ..engine.generator import Generator

        if pool < batch:
            raise ValueError(f"distill_pool ({pool}) must be at least the batch size ({batch})")
        self.cfg = model.config
        if cfg_scale != 1 and not self.cfg.has_null_class:
            raise ValueError(f"distill_cfg_scale {cfg_scale} needs a null class, and this model has none "
                             "(trained with class_dropout_prob 0): use 1")
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
        self.batch, self.pool, self.cfg_scale, self.seed = batch, pool, float(cfg_scale), seed
        self.divergence = divergence
        self.chunks = pool // batch
        self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        load_into(self.teacher, teacher_state, what="the distillation teacher (init_from)")
        # the sampler: a second copy the Generator may cast (fp32, as the evaluations sample) and capture;
        # refreshed in place (same tensors, so a captured CUDA graph stays valid)
        sampler = copy.deepcopy(model).requires_grad_(False)
        self.generator = Generator(sampler, device=device, dtype="fp32", policy=policy)
        self._tokens = self._labels = None
        self._refreshed_at = None

    def request(self, r: int) -> tuple[torch.Tensor, list[int]]:
        """Pool ``r``'s classes (uniform, (pool,)) and its images' sampling keys."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + r)
        labels = torch.randint(self.cfg.num_classes, (self.pool,), generator=g)  # (pool,)
        return labels, [(self.seed + 1) * 1_000_000_007 + r * self.pool + i for i in range(self.pool)]

    def _refresh(self, model: GPT, r: int) -> None:
        self.generator.gpt.load_state_dict({k: v.detach() for k, v in model.state_dict().items()})
        labels, keys = self.request(r)
        self._tokens = self.generator.sample_tokens(labels, cfg_scale=self.cfg_scale, seed=keys)  # (pool, N)
        self._labels = labels.to(self._tokens.device)
        self._refreshed_at = r

    def batch_at(self, model: GPT, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled ``(tokens (B, N), labels (B,))`` of training step ``step`` (refreshing the pool first
        when ``step`` starts a new one, or when this call has none yet, as after a resume)."""
        r, i = divmod(step, self.chunks)
        if self._refreshed_at != r:
            self._refresh(model, r)
        sl = slice(i * self.batch, (i + 1) * self.batch)
        return self._tokens[sl], self._labels[sl]

    def guided_logits(self, gpt: GPT, tokens: torch.Tensor, labels: torch.Tensor, backend=None) -> torch.Tensor:
        """The logits the sampler draws each token from: ``u + s (c - u)`` of the conditional and null-class
        rows (the conditional alone when ``cfg_scale`` is 1), (B, N, vocab)."""
        if self.cfg_scale == 1:
            return gpt.logits(labels, tokens, backend=backend)
        both = gpt.logits(torch.cat([labels, torch.full_like(labels, self.cfg.num_classes)]),
                          torch.cat([tokens, tokens]), backend=backend)  # (2B, N, vocab)
        cond, uncond = both.float().chunk(2)
        return uncond + self.cfg_scale * (cond - uncond)

    def loss(self, model: GPT, tokens: torch.Tensor, labels: torch.Tensor, backend) -> torch.Tensor:
        """The KL divergence (``divergence``) between the dense teacher's and the student's guided next-token
        distributions, the student's attention restricted to the policy's read sets (``backend``),
        per token (nats)."""
        with torch.no_grad():
            teacher = self.guided_logits(self.teacher, tokens, labels)
        return kl_divergence(teacher, self.guided_logits(model, tokens, labels, backend), self.divergence)
