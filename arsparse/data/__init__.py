"""Data sets that install from a package registry (no downloads at run time)."""
from .fashion import FASHION_CLASSES, FashionDataError, fetch_fashion, find_fashion_dir, load_fashion, read_idx

__all__ = ["FASHION_CLASSES", "FashionDataError", "fetch_fashion", "find_fashion_dir", "load_fashion", "read_idx"]
