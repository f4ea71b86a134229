"""arsparse: fast autoregressive image generation by exploiting the sparsity of its attention."""
from . import policies
from .bundles import load_model
from .engine.generator import Generator
from .layout import Layout
from .loading import load_gpt, load_vq

__all__ = ["Generator", "Layout", "load_gpt", "load_model", "load_vq", "policies"]
__version__ = "0.1.0"
