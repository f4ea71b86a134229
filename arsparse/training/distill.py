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
   is pulled towards the frozen *dense* teacher (the weights the run started from) by the forward
   KL divergence ``KL(teacher || student)`` of every next-token distribution, for the conditional
   rows and for the same sequences under the null class (guidance mixes both).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..checkpoint import load_into
from ..models.gpt import GPT

__all__ = ["OnPolicyDistiller", "forward_kl"]


def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of ``KL(softmax(teacher) || softmax(student))`` in nats, computed in fp32.

    Both ``(..., vocab)``; the result has the gradient of the student only.
    """
    log_p = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


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
        Guidance the pool is sampled with (the model's usual; 1: none).
    device : torch.device
    seed : int
        The pool of refresh ``r`` uses image keys ``(seed, r * pool + i)``: reproducible, and apart
        from the evaluation's seeds.
    """

    def __init__(self, model: GPT, teacher_state: dict, policy: str, pool: int, batch: int, cfg_scale: float,
                 device: torch.device, seed: int):
        from ..engine.generator import Generator

        if pool < batch:
            raise ValueError(f"distill_pool ({pool}) must be at least the batch size ({batch})")
        self.cfg = model.config
        self.null = self.cfg.has_null_class
        if cfg_scale != 1 and not self.null:
            raise ValueError(f"distill_cfg_scale {cfg_scale} needs a null class, and this model has none "
                             "(trained with class_dropout_prob 0): use 1")
        self.batch, self.pool, self.cfg_scale, self.seed = batch, pool, float(cfg_scale), seed
        self.chunks = pool // batch
        self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        load_into(self.teacher, teacher_state, what="the distillation teacher (init_from)")
        # the sampler: a second copy the Generator may cast and capture; refreshed in place (same tensors,
        # so a captured CUDA graph stays valid)
        sampler = copy.deepcopy(model).requires_grad_(False)
        self.generator = Generator(sampler, device=device, dtype="fp32", policy=policy)
        self._tokens = self._labels = None
        self._refreshed_at = None

    def request(self, r: int) -> tuple[torch.Tensor, list[int]]:
        """Pool ``r``'s classes (uniform, (pool,)) and its images' sampling keys."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + r)
        labels = torch.randint(self.cfg.num_classes, (self.pool,), generator=g)  # (pool,)
        return labels, [self.seed * 1_000_000_007 + r * self.pool + i for i in range(self.pool)]

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

    def loss(self, model: GPT, tokens: torch.Tensor, labels: torch.Tensor, backend) -> torch.Tensor:
        """``KL(dense teacher || student under the policy's read sets)`` per next token (nats), averaged over
        the sequences with their class and with the null class (when the model has one)."""
        x, y = tokens, labels  # (B, N), (B,)
        if self.null:  # the null rows too (B -> 2B)
            x, y = torch.cat([x, x]), torch.cat([y, torch.full_like(y, self.cfg.num_classes)])
        with torch.no_grad():
            teacher = self.teacher.logits(y, x)  # (2B, N, vocab)
        return forward_kl(teacher, model.logits(y, x, backend=backend))
