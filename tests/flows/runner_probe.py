"""What a hostile workload tries against the guest runner that started it (issue 19,
finding 9). Stdlib only: it runs as a plain command and inside a Python task."""

from __future__ import annotations

import json
import os


def _status(pid: int | str, field: str) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError as e:
        return f"denied {e.errno}"
    return ""


def _read_environ(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return "read " + f.read().decode("latin-1")
    except OSError as e:
        return f"denied {e.errno}"


def _read_mem(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            region = next(line for line in f if " rw" in line or " r-" in line)
        start = int(region.split("-", 1)[0], 16)
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.seek(start)
            return f"read {len(f.read(4096))} bytes"
    except (OSError, StopIteration, ValueError) as e:
        return f"denied {getattr(e, 'errno', e)}"


def _write_into(directory: str) -> str:
    try:
        with open(os.path.join(directory, "forged-by-the-workload.txt"), "w") as f:
            f.write("forged")
        return "wrote"
    except OSError as e:
        return f"denied {e.errno}"


def probe() -> dict[str, object]:
    runner = os.getppid()
    node_dir = os.path.join(
        os.environ.get("RESOLUTO_STORE_ROOT", "/conduit"), os.environ["RESOLUTO_STORE_PREFIX"]
    )
    listing: object
    try:
        listing = sorted(os.listdir(node_dir))
    except OSError as e:
        listing = f"denied {e.errno}"
    return {
        "uid": os.getresuid(),
        "gid": os.getresgid(),
        "groups": os.getgroups(),
        "caps": {k: _status("self", k) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
        "no_new_privs": _status("self", "NoNewPrivs"),
        "runner_uid": _status(runner, "Uid"),
        "runner_environ": _read_environ(runner),
        "pid1_environ": _read_environ(1),
        "runner_mem": _read_mem(runner),
        "pid1_mem": _read_mem(1),
        "conduit_listing": listing,
        "conduit_write": _write_into(node_dir),
        "workspace_write": _write_into(os.getcwd()),
    }


if __name__ == "__main__":
    print("PROBE " + json.dumps(probe()), flush=True)
