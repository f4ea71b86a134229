"""HTTP serving: a FastAPI app over the engine, continuous batching, metrics and a web page.

Needs the ``serve`` extra (``pip install 'arsparse[serve]'``). Start it with ``arsparse serve``
or build the app with :func:`create_app`.
"""
from .config import ServeConfig


def create_app(*args, **kwargs):
    """See :func:`arsparse.serve.app.create_app` (imported lazily: FastAPI is an optional dependency)."""
    from .app import create_app as _create

    return _create(*args, **kwargs)


__all__ = ["ServeConfig", "create_app"]
