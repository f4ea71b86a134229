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
