"""Throughput mode: the largest batch a policy's cache allows within a memory budget."""
from __future__ import annotations

import torch

from ..models.gpt import GPT


def cache_bytes_per_sequence(gpt: GPT, policy=None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one sequence's cache takes under ``policy`` (built on the meta device: nothing is allocated)."""
    from ..policies import get, resolve

    pol = resolve(policy) or get("dense")
    pol = pol.prepare(gpt)
    return pol.make_cache(gpt.config, 1, dtype, torch.device("meta")).nbytes()


def step_workspace_per_sequence(gpt: GPT) -> int:
    """Transient bytes a decode step needs per sequence: fp32 logits and the sampling buffers (a few copies)."""
    cfg = gpt.config
    return 8 * cfg.vocab_size * 4 + 16 * max(cfg.dim, cfg.ffn_hidden) * 4


def max_batch(gpt: GPT, policy=None, memory_bytes: int | None = None, guidance: bool = True,
              dtype: torch.dtype = torch.bfloat16, reserve_bytes: int = 2 << 30) -> int:
    """Images that fit: (memory - weights - reserve) / (sequences per image x (cache + workspace)), and
    at most as many as keep each layer's cache tensors within the Triton kernels' 32-bit offsets.

    ``memory_bytes`` defaults to the free memory of the current CUDA device, counting what PyTorch's
    allocator holds but does not use as free.
    """
    if memory_bytes is None:
        if not torch.cuda.is_available():
            raise ValueError("memory_bytes is needed without a CUDA device")
        memory_bytes = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    weights = sum(p.numel() for p in gpt.parameters()) * torch.finfo(dtype).bits // 8
    seq_bytes = cache_bytes_per_sequence(gpt, policy, dtype)
    per_image = (2 if guidance else 1) * (seq_bytes + step_workspace_per_sequence(gpt))
    free = memory_bytes - weights - reserve_bytes
    if free < per_image:
        raise ValueError(f"{memory_bytes / 2**30:.1f} GiB do not fit even one image: weights take "
                         f"{weights / 2**30:.2f} GiB and one image needs {per_image / 2**20:.1f} MiB")
    # a layer's keys (or values) of one sequence, all its tensors together: no single tensor is larger
    per_tensor = max(1, seq_bytes // (2 * gpt.config.n_layer * (torch.finfo(dtype).bits // 8)))
    return min(int(free // per_image), (2**31 - 1) // per_tensor // (2 if guidance else 1))
