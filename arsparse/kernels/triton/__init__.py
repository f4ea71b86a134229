"""Triton kernels (CUDA, or the CPU through ``TRITON_INTERPRET=1``)."""
from .decode import decode_attention
from .ring import ring_decode_attention
from .slots import slot_decode_attention

__all__ = ["decode_attention", "ring_decode_attention", "slot_decode_attention"]
