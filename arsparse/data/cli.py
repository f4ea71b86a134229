"""``arsparse data fetch | info``: install the data sets the shipped models are trained on."""
from __future__ import annotations

import argparse

__all__ = ["add_data_parser"]

DATA_NAMES = ("emoji", "fashion")


def cmd_fetch(args) -> int:
    if args.name == "fashion":
        from .fashion import fetch_fashion

        print(f"Fashion-MNIST: {fetch_fashion(args.cache_dir)}")
        return 0
    from .emoji import emoji_summary, load_emoji_table

    data = load_emoji_table(args.cache_dir, fetch=True, quiet=False)
    print(emoji_summary(data))
    return 0


def cmd_info(args) -> int:
    if args.name == "fashion":
        from .fashion import FASHION_CLASSES, find_fashion_dir, load_fashion

        d = find_fashion_dir(args.cache_dir)
        counts = [load_fashion(s, root=args.cache_dir)[1].bincount(minlength=10).tolist() for s in ("train", "test")]
        print(f"Fashion-MNIST in {d}")
        for i, name in enumerate(FASHION_CLASSES):
            print(f"{i:>5}  {name:<16}{counts[0][i]:>7}{counts[1][i]:>6}")
        return 0
    from .emoji import emoji_cache_dir, emoji_summary, load_emoji_table

    print(f"emoji in {emoji_cache_dir(args.cache_dir)}")
    print(emoji_summary(load_emoji_table(args.cache_dir)))
    return 0


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``data {fetch,info}`` to an argparse subparsers object."""
    p = subparsers.add_parser("data", help="fetch the training data sets from package registries (apt, npm)",
                              description="Fetch or describe a data set: fashion (Debian package "
                                          "dataset-fashion-mnist, via apt) or emoji (npm packages "
                                          "emoji-datasource-google and emoji-datasource-twitter, via npm pack).")
    sub = p.add_subparsers(dest="data_command", required=True, metavar="{fetch,info}")
    for name, func, text in (("fetch", cmd_fetch, "download (if missing), decode and list the classes"),
                             ("info", cmd_info, "list the classes and split sizes of installed data")):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("name", choices=DATA_NAMES)
        s.add_argument("--cache-dir", help="data folder (default: $ARSPARSE_DATA/<name>, else ~/.cache/arsparse/emoji "
                                           "for emoji, /usr/share/datasets/fashion-mnist for fashion)")
        s.set_defaults(func=func)
    return p
