"""The built-in policies, registered under their names."""
from __future__ import annotations

from dataclasses import dataclass

from . import register_policy
from .base import Budget, Policy, dense_entries
from .offset import DiagonalPolicy, StreamingPolicy
from .scored import ADSAPolicy, H2OPolicy, LinesPolicy, TOVAPolicy


@register_policy("dense")
@dataclass(frozen=True)
class DensePolicy(Policy):
    """Dense attention, the oracle: every policy path must agree with it when nothing is skipped."""

    source = "Vaswani et al., Attention Is All You Need, 2017"
    kind = "dense"

    def make_cache(self, cfg, rows, dtype, device, kernel="torch"):
        from ..engine.cache import DenseKVCache

        return DenseKVCache(cfg, rows, dtype, device, kernel=kernel)

    def teacher_forced_logits(self, gpt, cond, tokens, prompt_mask=None):
        return gpt.logits(cond, tokens, prompt_mask=prompt_mask)

    def budget(self, layout, n_layer=1, n_head=1):
        P, N = layout.prefix_len, layout.image_tokens
        return Budget(read=P + (N - 1) / 2 + 0.5, kept=dense_entries(layout), dense=dense_entries(layout))


register_policy("streaming")(StreamingPolicy)
register_policy("diagonal")(DiagonalPolicy)
register_policy("h2o")(H2OPolicy)
register_policy("tova")(TOVAPolicy)
register_policy("lines")(LinesPolicy)
register_policy("adsa")(ADSAPolicy)

from .headwise import DiagonalAdaptivePolicy, HeadKVPolicy, SSHPolicy  # noqa: E402

register_policy("headkv")(HeadKVPolicy)
register_policy("ssh")(SSHPolicy)
register_policy("diagonal-adaptive")(DiagonalAdaptivePolicy)
