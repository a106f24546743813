"""Old import path of :mod:`prefect_resoluto.runtimes.kubernetes.render`, kept for existing callers."""

from prefect_resoluto.runtimes.kubernetes.render import (
    SECRET_PLACEHOLDER,
    render_documents,
    render_yaml,
    to_yaml,
)

__all__ = ["SECRET_PLACEHOLDER", "render_documents", "render_yaml", "to_yaml"]
