"""Ship the guest runner to a sandbox through the conduit, so any Python image can run it.

A remote sandbox (a Kubernetes pod, a container on another host) cannot import the
host's ``guest_runner`` package. Instead of requiring a custom image, the host uploads a
small tarball of the package once per run, under a key *outside* every node's inbox
(inbox archives are extracted into the workspace, the runner must not be)::

    [<base>/]run/<run_id>/_guest/guest_runner-<sha256[:16]>.tar.gz

and the sandbox starts with :func:`bootstrap_command`: a few lines of ``python3 -c``
that fetch the object with boto3, check its SHA-256, unpack it into a fresh temporary
directory and ``exec`` ``python3 -m guest_runner`` from there.

The tarball is deterministic (sorted members, zero mtimes, fixed owner and modes, gzip
without a timestamp), so its hash names the code exactly and uploads are idempotent.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
import tarfile
from pathlib import Path

import guest_runner
from guest_runner import wire
from guest_runner.conduit import Conduit

GUEST_DIR = "_guest"
PACKAGE = "guest_runner"

#: Environment variables the bootstrap reads (besides the RESOLUTO_STORE_* of the conduit).
ENV_BUNDLE_KEY = wire.ENV_GUEST_BUNDLE_KEY
ENV_BUNDLE_SHA256 = wire.ENV_GUEST_BUNDLE_SHA256


def _package_files() -> list[tuple[str, Path]]:
    root = Path(guest_runner.__file__).resolve().parent
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or not path.is_file():
            continue
        if path.suffix not in (".py", ".json", ".typed"):
            continue
        files.append((f"{PACKAGE}/{rel.as_posix()}", path))
    if not any(name == f"{PACKAGE}/__main__.py" for name, _ in files):
        raise RuntimeError(f"the installed guest_runner package at {root} has no __main__.py")
    return files


@functools.lru_cache(maxsize=1)
def build_guest_bundle() -> tuple[str, bytes]:
    """``(sha256 hex, tar.gz bytes)`` of the installed ``guest_runner`` package.

    Byte-for-byte deterministic for the same sources, so the hash identifies the code.
    """
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({name.rsplit("/", 1)[0] for name, _ in _package_files()})
        seen_dirs: set[str] = set()
        for d in dirs:
            parts = d.split("/")
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                if sub in seen_dirs:
                    continue
                seen_dirs.add(sub)
                info = tarfile.TarInfo(sub)
                info.type = tarfile.DIRTYPE
                _normalise(info, 0o755)
                tar.addfile(info)
        for name, path in _package_files():
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            _normalise(info, 0o644)
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    blob = out.getvalue()
    return hashlib.sha256(blob).hexdigest(), blob


def _normalise(info: tarfile.TarInfo, mode: int) -> None:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = mode
    info.pax_headers = {}


def guest_bundle_key(run_id: str, base: str = "", sha: str | None = None) -> str:
    """Key of the run's guest bundle: ``[<base>/]run/<run_id>/_guest/guest_runner-<sha16>.tar.gz``.

    ``base`` is the conduit's base prefix when the key is handed to the sandbox (which
    addresses the bucket directly); leave it empty for a key given to the conduit itself.
    """
    if sha is None:
        sha, _ = build_guest_bundle()
    return f"{wire.run_prefix(run_id, base)}/{GUEST_DIR}/{PACKAGE}-{sha[:16]}.tar.gz"


def upload_guest_bundle(conduit: Conduit, run_id: str) -> tuple[str, str]:
    """Put the bundle on ``conduit`` unless it is already there.

    Returns ``(full key as the sandbox sees it, sha256)``; the full key includes the
    conduit's base prefix.
    """
    from guest_runner.conduit import ObjectNotFound

    sha, blob = build_guest_bundle()
    key = guest_bundle_key(run_id, "", sha)
    try:
        present = conduit.get(key) == blob
    except ObjectNotFound:
        present = False
    if not present:
        conduit.put(key, blob)
    return guest_bundle_key(run_id, conduit.base_prefix, sha), sha


# The bootstrap runs in the sandbox's Python (3.9+), with boto3 and nothing of ours.
# It must stay short (it is a command-line argument, visible in the pod spec) and
# readable: an operator reviewing a rendered manifest should see what it does.
_BOOTSTRAP = """\
import hashlib, io, os, sys, tarfile, tempfile
e = os.environ
try:
    import boto3
    from botocore.config import Config
except ImportError as x:
    sys.exit("resoluto bootstrap: this image has no boto3 (%s); use an image with python3 + boto3" % x)
kw = {"config": Config(s3={"addressing_style": "path"} if e.get("RESOLUTO_STORE_ENDPOINT") else {},
                       retries={"mode": "standard", "max_attempts": 5})}
if e.get("RESOLUTO_STORE_ENDPOINT"): kw["endpoint_url"] = e["RESOLUTO_STORE_ENDPOINT"]
if e.get("RESOLUTO_STORE_REGION"): kw["region_name"] = e["RESOLUTO_STORE_REGION"]
key = e["RESOLUTO_GUEST_BUNDLE_KEY"]
blob = boto3.client("s3", **kw).get_object(Bucket=e["RESOLUTO_STORE_BUCKET"], Key=key)["Body"].read()
if hashlib.sha256(blob).hexdigest() != e["RESOLUTO_GUEST_BUNDLE_SHA256"]:
    sys.exit("resoluto bootstrap: %s does not match its expected SHA-256" % key)
d = tempfile.mkdtemp(prefix="resoluto-guest-")
with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as t:
    t.extractall(d, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
e["PYTHONPATH"] = d + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
sys.stderr.write("resoluto bootstrap: guest_runner %s from %s\\n" % (e["RESOLUTO_GUEST_BUNDLE_SHA256"][:16], d))
sys.stderr.flush()
os.chdir(d)
os.execv(sys.executable, [sys.executable, "-m", "guest_runner"])
"""


def bootstrap_command(python: str = "python3") -> list[str]:
    """The container command that fetches the bundle and runs ``python -m guest_runner``.

    Reads ``RESOLUTO_GUEST_BUNDLE_KEY`` / ``RESOLUTO_GUEST_BUNDLE_SHA256`` and the
    conduit's ``RESOLUTO_STORE_BUCKET`` / ``_ENDPOINT`` / ``_REGION``; store credentials
    come from the usual AWS variables or the pod's workload identity.
    """
    return [python, "-c", _BOOTSTRAP]
