"""Host side of a Python task crossing into the sandbox, with nothing pickled.

The function travels by reference (a workspace-relative source file + qualname, or an
importable ``module:qualname``), the parameters as JSON. Anything that cannot make the
trip is refused here, before a sandbox starts, with what to do instead.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guest_runner import archive, call
from guest_runner.wire import WireError

CALL_ARCHIVE = "call"
RESULT_PATHS = [call.RETURN_FILE, call.ERROR_FILE]


class NotSandboxable(TypeError):
    """A task, parameter or result that cannot cross the sandbox boundary."""


class RemoteTaskError(RuntimeError):
    """The task's function raised inside the sandbox."""

    def __init__(self, type_name: str, message: str, traceback: str) -> None:
        self.remote_type = type_name
        self.remote_message = message
        self.remote_traceback = traceback
        text = f"{type_name}: {message}"
        if traceback:
            text += "\n--- traceback from the sandbox ---\n" + traceback.rstrip()
        super().__init__(text)


def function_ref(fn: Callable[..., Any], workspace: Path | None) -> dict[str, str]:
    """How the guest finds ``fn``: by file in the workspace, else by importable module."""
    qualname = getattr(fn, "__qualname__", "")
    name = getattr(fn, "__name__", repr(fn))
    if name == "<lambda>" or "<lambda>" in qualname:
        raise NotSandboxable(f"task function {qualname or name!r} is a lambda; define it with def at module level")
    if "<locals>" in qualname:
        raise NotSandboxable(
            f"task function {qualname!r} is defined inside another function; the sandbox imports task "
            "functions by name, so move it to module level"
        )
    src = _source_file(fn)
    if workspace is not None and src:
        try:
            rel = Path(src).resolve().relative_to(Path(workspace).resolve())
            return {"file": rel.as_posix(), "qualname": qualname}
        except ValueError:
            pass
    module = getattr(fn, "__module__", None)
    if module and module != "__main__" and module in sys.modules:
        spec = getattr(sys.modules[module], "__spec__", None)
        if spec is not None and spec.origin and "site-packages" in spec.origin:
            return {"module": module, "qualname": qualname}
    raise NotSandboxable(
        f"task function {qualname!r} lives in {src or module!r}, outside the workspace {str(workspace)!r}, "
        "and is not an installed module; set the runner's workspace to a directory that contains its file"
    )


def _source_file(fn: Callable[..., Any]) -> str | None:
    """The file defining ``fn``, also when Prefect loaded it from a deployment's entrypoint
    script (its code then reports "<dynamic-code>" instead of a path)."""
    import os

    try:
        src = inspect.getsourcefile(fn)
    except TypeError:
        src = None
    if src and os.path.isfile(src):
        return src
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    mod_file = getattr(module, "__file__", None)
    if mod_file and os.path.isfile(mod_file):
        return mod_file
    # A flow run started by a runner/worker: the function lives in the entrypoint's script.
    entrypoint = os.environ.get("PREFECT__FLOW_ENTRYPOINT", "")
    path = entrypoint.rsplit(":", 1)[0] if ":" in entrypoint else ""
    if path.endswith(".py") and os.path.isfile(path):
        return os.path.abspath(path)
    return src


def encode_parameters(task_name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    from pydantic_core import PydanticSerializationError, to_jsonable_python

    out: dict[str, Any] = {}
    for name, value in parameters.items():
        try:
            out[name] = to_jsonable_python(value)
            json.dumps(out[name], allow_nan=True)
        except (PydanticSerializationError, TypeError, ValueError):
            raise NotSandboxable(
                f"parameter {name!r} of task {task_name!r} is a {type(value).__module__}."
                f"{type(value).__qualname__}, which cannot cross into the sandbox as JSON. Write it to a "
                "file in the workspace and pass the file's path instead."
            ) from None
    return out


def call_archive(ref: dict[str, str], parameters: dict[str, Any], *, real_prefect: bool = False) -> bytes:
    body = json.dumps({**ref, "parameters": parameters, "real_prefect": real_prefect}).encode()
    return archive.pack(_empty_dir(), patterns=[], extra=[(call.CALL_FILE, body)])


def _empty_dir() -> Path:
    import tempfile

    d = Path(tempfile.gettempdir()) / "resoluto-empty"
    d.mkdir(exist_ok=True)
    return d


def guest_argv(python: str = "python3") -> list[str]:
    return [python, "-m", "guest_runner.call", call.CALL_FILE]


def read_outcome(output_dir: Path | None) -> tuple[bool, Any]:
    """(True, value) from return.json, or raises RemoteTaskError from error.json."""
    if output_dir is not None:
        err = output_dir / call.ERROR_FILE
        if err.is_file():
            e = json.loads(err.read_text())
            raise RemoteTaskError(str(e.get("type", "Exception")), str(e.get("message", "")),
                                  str(e.get("traceback", "")))
        ret = output_dir / call.RETURN_FILE
        if ret.is_file():
            try:
                return True, json.loads(ret.read_text())["value"]
            except (ValueError, KeyError) as e:
                raise WireError(f"{call.RETURN_FILE} from the sandbox is malformed: {e}") from None
    return False, None


def rebuild(value: Any, annotation: Any) -> Any:
    """Turn the JSON return value back into the task's annotated type, where it says one."""
    if annotation in (inspect.Signature.empty, Any, None) or isinstance(annotation, str):
        return value
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(annotation).validate_python(value)
    except (ValidationError, TypeError, NameError):
        return value  # the annotation does not describe what came back; hand over the JSON


def return_annotation(fn: Callable[..., Any]) -> Any:
    try:
        import typing

        return typing.get_type_hints(fn).get("return", inspect.Signature.empty)
    except Exception:
        return inspect.Signature.empty
