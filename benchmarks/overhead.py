"""Figure 1, overhead: a trivial node through the node driver vs. the bare runtime.

For each runtime available here, N trivial nodes (``python -c pass``) go through
:func:`prefect_resoluto.node.drive.drive_node` on a local conduit, interleaved with N bare
launches of the same runtime running the same command without prefect-resoluto:

* ``process``: a plain ``subprocess.run``;
* ``bubblewrap``: the same ``bwrap`` argv the runtime builds (``build_argv``);
* ``gvisor``: ``runsc run`` of the same OCI bundle the runtime builds, one container id per run;
* ``container``: the same ``podman run`` argv, in the foreground with ``--rm``.

Medians, ratio driver/bare and the absolute milliseconds added per node.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import TRIVIAL, Target, log, median, ms, r3, scratch, timed

from guest_runner.conduit import LocalConduit
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes import get_runtime
from prefect_resoluto.runtimes.base import LaunchSpec, SandboxRuntime

RUNTIMES = ("process", "bubblewrap", "gvisor", "container")


def bare_launcher(name: str, rt: SandboxRuntime, work: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """(run one bare launch, clean up) for runtime ``name``: same sandbox, same command, no driver."""
    spec = LaunchSpec(sandbox_id=f"bare-{uuid.uuid4().hex[:8]}", env={}, command=list(TRIVIAL))
    if name == "process":
        cwd = work / "bare-cwd"
        cwd.mkdir(exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "LANG": "C.UTF-8"}

        def run_process() -> None:
            subprocess.run(TRIVIAL, env=env, cwd=cwd, check=True, stdin=subprocess.DEVNULL)

        return run_process, lambda: None
    if name == "bubblewrap":
        ws = work / "bare-ws"
        ws.mkdir(exist_ok=True)
        argv, env = rt.build_argv(spec, ws)  # type: ignore[attr-defined]

        def run_bwrap() -> None:
            subprocess.run(argv, env=env, check=True, stdin=subprocess.DEVNULL)

        return run_bwrap, lambda: None
    if name == "gvisor":
        d = work / spec.sandbox_id
        d.mkdir()
        prep = rt._prepare(spec, d)  # type: ignore[attr-defined]  # the runtime's own bundle
        counter = iter(range(1_000_000))

        def run_runsc() -> None:
            argv = list(prep.argv)
            argv[-1] = f"{spec.sandbox_id}-{next(counter)}"
            res = subprocess.run(
                argv, env=prep.env, cwd=prep.cwd, stdin=subprocess.DEVNULL, capture_output=True
            )
            if res.returncode != 0:
                raise RuntimeError(
                    f"bare runsc run failed ({res.returncode}): {res.stderr.decode(errors='replace')[-800:]}"
                )

        def cleanup_runsc() -> None:
            from prefect_resoluto.runtimes import _cgroup

            cg = _cgroup.existing(rt._cgroup_name(spec.sandbox_id))  # type: ignore[attr-defined]
            if cg is not None:
                cg.remove()

        return run_runsc, cleanup_runsc
    if name == "container":
        image = rt.ensure_skeleton_image()  # type: ignore[attr-defined]
        argv0 = rt.build_run_argv(spec, image, None, True)  # type: ignore[attr-defined]
        counter = iter(range(1_000_000))

        def run_podman() -> None:
            argv = list(argv0)
            i = argv.index("-d")
            argv[i] = "--rm"
            argv[argv.index("--name") + 1] = f"{spec.sandbox_id}-{next(counter)}"
            subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

        return run_podman, lambda: None
    raise ValueError(name)


def driver_launcher(rt: SandboxRuntime, work: Path, tag: str) -> Callable[[], None]:
    conduit = LocalConduit(work / "conduit")
    counter = iter(range(1_000_000))

    def run_node() -> None:
        spec = NodeSpec(run_id="bench-overhead", node_id=f"{tag}-{next(counter)}", argv=list(TRIVIAL))
        out = drive_node(spec, conduit, rt, min_isolation="none")
        if not out.ok:
            raise RuntimeError(f"trivial node failed on {rt.name}: {out.describe()}")

    return run_node


def measure_runtime(name: str, n: int) -> dict[str, Any]:
    rt = get_runtime(name)
    avail = rt.availability()
    if not avail.ok:
        return {"available": False, "why": avail.why}
    with scratch(f"overhead-{name}") as work:
        bare, cleanup = bare_launcher(name, rt, work)
        driver = driver_launcher(rt, work, name)
        try:
            bare()  # warm-up: page cache, image import, first-run costs
            driver()
            bare_t: list[float] = []
            drv_t: list[float] = []
            for _ in range(n):  # interleaved, so drift in machine load hits both alike
                bare_t.append(timed(bare)[0])
                drv_t.append(timed(driver)[0])
        finally:
            cleanup()
    b, d = median(bare_t), median(drv_t)
    return {
        "available": True,
        "n": n,
        "bare_median_ms": ms(b),
        "driver_median_ms": ms(d),
        "ratio": r3(d / b),
        "added_ms": ms(d - b),
        "bare_ms": [ms(x) for x in bare_t],
        "driver_ms": [ms(x) for x in drv_t],
    }


def run(quick: bool) -> dict[str, Any]:
    n = 5 if quick else 20
    out: dict[str, Any] = {}
    for name in RUNTIMES:
        log(f"overhead: {name} (N={n})")
        try:
            out[name] = measure_runtime(name, n)
        except Exception as e:  # one broken runtime must not sink the whole run
            out[name] = {"available": False, "why": f"{type(e).__name__}: {e}"}
    return out


def targets(res: dict[str, Any]) -> list[Target]:
    t: list[Target] = []
    g = res.get("gvisor", {})
    if g.get("available"):
        t.append(
            Target("overhead", "gVisor driver/bare ratio", "<= 1.15", f"{g['ratio']}", g["ratio"] <= 1.15)
        )
    else:
        t.append(Target("overhead", "gVisor driver/bare ratio", "<= 1.15", "unavailable", None))
    p = res.get("process", {})
    if p.get("available"):
        t.append(
            Target(
                "overhead",
                "process: ms added per node",
                "<= 50 ms",
                f"{p['added_ms']} ms",
                p["added_ms"] <= 50,
            )
        )
    return t


def rows(res: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for name in RUNTIMES:
        r = res.get(name, {})
        if not r.get("available"):
            out.append((f"overhead {name}", f"unavailable: {r.get('why', '?')}"))
            continue
        out.append(
            (
                f"overhead {name}",
                f"driver {r['driver_median_ms']} ms vs bare {r['bare_median_ms']} ms: "
                f"x{r['ratio']}, +{r['added_ms']} ms (N={r['n']})",
            )
        )
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run("--quick" in sys.argv), indent=1))
