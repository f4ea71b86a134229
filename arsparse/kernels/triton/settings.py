"""Launch settings given as JSON text (``arsparse bench --matvec-launch``, ``--variant dense.KEY=INT``)."""
from __future__ import annotations

import json


def json_settings(text: str, defaults: dict, what: str) -> dict:
    """``text``: a JSON object whose keys are among ``defaults``' -> that object (its values are the
    caller's to check); else a ValueError naming ``what`` and the keys allowed."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} settings must be a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(given, dict) or set(given) - set(defaults):
        raise ValueError(f"{what} settings must be a JSON object with keys from {sorted(defaults)}, got {text!r}")
    return given


def parse_tile_launch(text: str, defaults: dict, what: str, switches: tuple = (), counts: tuple = ()) -> dict:
    """``text`` (JSON) -> ``defaults`` with those settings, checked: ``switches`` 0 or 1, ``counts`` ints
    >= 0, ``num_stages`` an int >= 1, ``num_warps`` 1, 2, 4, 8 or 16, any other key (a tile size) a power of 2 >= 16."""
    given = json_settings(text, defaults, what)
    for k, v in given.items():
        if k in switches:
            ok, allowed = type(v) is int and v in (0, 1), "0 or 1"
        elif k in counts:
            ok, allowed = type(v) is int and v >= 0, "an int >= 0"
        elif k == "num_stages":
            ok, allowed = type(v) is int and v >= 1, "an int >= 1"
        elif k == "num_warps":
            ok, allowed = v in (1, 2, 4, 8, 16) and type(v) is int, "1, 2, 4, 8 or 16"
        else:
            ok, allowed = type(v) is int and v >= 16 and not v & (v - 1), "a power of 2 >= 16"
        if not ok:
            raise ValueError(f"{what} setting {k}={v!r} is invalid: must be {allowed}")
    return dict(defaults, **given)
