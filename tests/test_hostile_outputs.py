"""A compromised guest's outputs, through the real path (issue 19, findings 1, 2 and 8).

The attacker is the guest runner itself (what a workload that took over its sandbox can
be): the sandbox, a real gVisor one started by the host's node driver or task runner, runs
a hostile script instead of the guest runner, which writes the node's conduit objects as
a guest would (an event chunk, result.json, an outbox archive, _manifest.json) with what
it likes in them. The host's real extraction and result reading then take them. Each
test checks the user-facing error, that a sentinel tree outside the outputs directory is
unchanged (nothing created, changed, linked or read there), and that the outputs
directory keeps nothing from the refused archive, while the archive stays in the conduit.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from flows import dropin_flows as df
from prefect import flow

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.node.drive import drive_node
from prefect_resoluto.node.spec import NodeSpec
from prefect_resoluto.runtimes.base import Resources

FLOWS = Path(df.__file__).parent

#: The compromised guest runner: writes the node's objects itself. argv: the outbox
#: archive (base64, or ``inbox:NAME`` for one the host staged in the inbox) and the status.
HOSTILE_GUEST = r"""
import base64, os, sys
from guest_runner import wire
run, node = os.environ["RESOLUTO_RUN_ID"], os.environ["RESOLUTO_NODE_ID"]
prefix = os.environ["RESOLUTO_STORE_PREFIX"]
d = os.path.join(os.environ["RESOLUTO_STORE_ROOT"], prefix)
arg, status = sys.argv[1], sys.argv[2]
if arg.startswith("inbox:"):
    with open(os.path.join(d, "inbox", arg[6:] + ".tar.gz"), "rb") as f:
        data = f.read()
else:
    data = base64.b64decode(arg)
def put(rel, b):
    p = os.path.join(d, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = os.path.join(os.path.dirname(p), ".resoluto-tmp-" + os.path.basename(p))
    with open(tmp, "wb") as f:
        f.write(b)
    os.rename(tmp, p)
put("outbox/output.tar.gz", data)
ev = wire.make_event(run, "node", "open", name=node)
close = dict(ev, event="close", status=status, ts=ev["ts"] + 0.001)
put("events-000001.jsonl", wire.encode_chunk([wire.encode_event(ev), wire.encode_event(close)]))
code = 0 if status == "success" else 1
put("result.json", wire.encode_result(wire.make_result(node, status, code, wire.outbox_key(prefix))))
put("_manifest.json", wire.encode_manifest(1))
print("planted", flush=True)
"""


def hostile_command(outbox: bytes | str, status: str = "success") -> list[str]:
    arg = outbox if isinstance(outbox, str) else base64.b64encode(outbox).decode()
    return ["python3", "-c", HOSTILE_GUEST, arg, status]


class _Patched:
    """Every sandbox the node driver launches runs ``command`` instead of the guest runner
    (LaunchSpec.command, as tests/test_node.py's _drive_with_command)."""

    def __init__(self, command: list[str]) -> None:
        self.command = command

    def __enter__(self) -> None:
        import prefect_resoluto.node.drive as node

        self.real = real = node.launch_spec
        command = self.command

        def patched(spec: Any, conduit: Any) -> Any:
            ls = real(spec, conduit)
            ls.command = command
            return ls

        node.launch_spec = patched

    def __exit__(self, *exc: object) -> None:
        import prefect_resoluto.node.drive as node

        node.launch_spec = self.real


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def reg(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def link(name: str, target: str, hard: bool = False) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    ti.linkname = target
    return ti, None


def directory(name: str) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE
    return ti, None


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root``: type, inode, link count, size, mtime, content."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            s = os.lstat(p)
            body = p.read_bytes() if stat.S_ISREG(s.st_mode) else None
            out[str(p.relative_to(root))] = (
                stat.S_IFMT(s.st_mode),
                s.st_ino,
                s.st_nlink,
                s.st_size,
                s.st_mtime_ns,
                body,
            )
    return out


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A sentinel tree next to the outputs directory, as any host file."""
    d = tmp_path / "host"
    (d / "sub").mkdir(parents=True)
    (d / "secret.txt").write_text("host secret, never to be read")
    (d / "sub" / "more.txt").write_text("more")
    return d


@pytest.fixture
def conduit(tmp_path: Path) -> LocalConduit:
    return LocalConduit(tmp_path / "conduit")


class NoWholeGets(LocalConduit):
    """A local conduit that records every object read whole with get()."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.whole: list[str] = []

    def get(self, key: str) -> bytes:
        self.whole.append(key)
        return super().get(key)


def run_hostile(tmp_path: Path, conduit: LocalConduit, gvisor: Any, outbox: bytes | str, **kw: Any) -> Any:
    spec = NodeSpec(
        run_id="run1",
        node_id=kw.pop("node_id", "node1"),
        argv=["true"],
        outputs_dir=tmp_path / "outputs",
        resources=kw.pop("resources", Resources.from_quantities(memory="256Mi", cpus="1")),
        **kw,
    )
    with _Patched(hostile_command(outbox)):
        return drive_node(spec, conduit, gvisor)


def assert_nothing_kept(tmp_path: Path, host: Path, before: dict[str, tuple[object, ...]]) -> None:
    assert snapshot(host) == before, "the host tree outside the outputs directory changed"
    outputs = tmp_path / "outputs"
    left = [p for p in outputs.rglob("*")] if outputs.exists() else []
    assert left == [], f"the refused archive left {left}"


@pytest.mark.sandbox
def test_a_symlink_through_an_earlier_symlink_is_refused(gvisor, conduit, tmp_path, host):
    """``out/a -> ..`` then ``out/b -> a/../host/secret.txt``: each text stays inside, the
    second goes through the first to a host file. Today's host makes both links."""
    before = snapshot(host)
    outbox = tar_gz([reg("out/ok.txt", b"fine"), link("out/a", ".."), link("out/b", "a/../host/secret.txt")])
    outcome = run_hostile(tmp_path, conduit, gvisor, outbox, output_paths=["out/**"])
    assert outcome.failure == "protocol", outcome.describe()
    assert "outbox rejected" in outcome.reason and "'out/a'" in outcome.reason
    assert "not a regular file extracted earlier from this archive" in outcome.reason
    assert_nothing_kept(tmp_path, host, before)
    assert (
        conduit.get_stream("run/run1/nodes/node1/outbox/output.tar.gz").read() == outbox
    )  # the evidence stays
    assert gvisor.list_ids() == []


@pytest.mark.sandbox
def test_a_hard_link_through_a_directory_symlink_to_a_never_extracted_member_is_refused(
    gvisor, conduit, tmp_path, host
):
    """``out/up`` is a directory symlink that climbs out of the outputs; a hard link names
    ``out/up/secret.txt``, a member that is in the archive but never extracted (a directory
    entry, skipped with output_paths). Today's host hard-links the output to the host file."""
    (tmp_path / "secret.txt").write_text("host secret next to the outputs")
    before = snapshot(host)
    outer = os.lstat(tmp_path / "secret.txt")
    outbox = tar_gz(
        [
            directory("out/up/secret.txt"),
            link("out/a", ".."),
            link("out/up", "a/.."),
            link("out/h", "out/up/secret.txt", hard=True),
        ]
    )
    outcome = run_hostile(tmp_path, conduit, gvisor, outbox, output_paths=["out/a", "out/up", "out/h"])
    assert outcome.failure == "protocol", outcome.describe()
    assert "outbox rejected" in outcome.reason and "not a regular file extracted earlier" in outcome.reason
    assert os.lstat(tmp_path / "secret.txt").st_nlink == outer.st_nlink == 1
    assert_nothing_kept(tmp_path, host, before)


@pytest.mark.sandbox
def test_a_gzip_bomb_stops_at_the_nodes_own_allowance(gvisor, tmp_path, host):
    """512 MiB of zeros in a 0.5 MB archive, from a sandbox with 256 MiB of memory: refused
    from the member's header at the node's allowance (its memory limit), streamed, never
    fetched whole. Today's host reads the archive whole and writes all 512 MiB."""
    conduit = NoWholeGets(tmp_path / "conduit")
    before = snapshot(host)
    size = 512 << 20
    ti = tarfile.TarInfo("out/zeros.bin")
    ti.size = size
    header = ti.tobuf(tarfile.PAX_FORMAT)
    mib = gzip.compress(b"\0" * (1 << 20), compresslevel=9)
    # Concatenated gzip members are one gzip stream: 512 MiB for ~0.5 MB, built instantly.
    bomb = gzip.compress(header) + mib * (size >> 20) + gzip.compress(b"\0" * 1024)
    assert len(bomb) < 1 << 20
    outcome = run_hostile(
        tmp_path, conduit, gvisor, "inbox:plant", extra_inbox={"plant": bomb}, output_paths=["out/**"]
    )
    assert outcome.failure == "protocol", outcome.describe()
    assert "'out/zeros.bin' is 536870912 bytes, more than the output limit of 268435456" in outcome.reason
    assert "256Mi (the node's memory limit)" in outcome.reason and "output_limit" in outcome.reason
    assert not [k for k in conduit.whole if "/outbox/" in k], conduit.whole
    assert_nothing_kept(tmp_path, host, before)


@pytest.mark.sandbox
def test_many_small_files_stop_at_the_output_limit_while_streaming(gvisor, conduit, tmp_path, host):
    """64 files of 1 MiB against output_limit=4 MiB: the fifth is refused before it is
    written, the four before it are removed, and the error names the setting."""
    before = snapshot(host)
    outbox = tar_gz([reg(f"out/f{i:02d}.bin", b"\0" * (1 << 20)) for i in range(64)])
    outcome = run_hostile(
        tmp_path,
        conduit,
        gvisor,
        "inbox:plant",
        extra_inbox={"plant": outbox},
        output_paths=["out/**"],
        output_limit=4 << 20,
    )
    assert outcome.failure == "protocol", outcome.describe()
    assert "more than the output limit of 4194304 bytes (at member 'out/f04.bin')" in outcome.reason
    assert "4Mi (the output_limit setting)" in outcome.reason
    assert_nothing_kept(tmp_path, host, before)


@pytest.mark.sandbox
def test_a_planted_outbox_link_is_not_followed(gvisor, conduit, tmp_path, host):
    """The guest writes its conduit directory: an outbox "archive" that is a link to a host
    file. The host does not read through it (today: an unhandled InvalidKey out of the node
    driver). A FIFO planted there does not reach the host's side of a gVisor mount (the
    gofer keeps it in the sandbox); the host's refusal of one is
    tests/test_local_conduit.py::test_get_stream_reads_in_pieces_and_never_follows_a_planted_link_or_fifo."""
    before = snapshot(host)
    plant = f"os.symlink({str(host / 'secret.txt')!r}, d + '/outbox/a-planted.tar.gz')"
    script = (
        "import os; d = os.path.join(os.environ['RESOLUTO_STORE_ROOT'], os.environ['RESOLUTO_STORE_PREFIX']);"
        f"os.makedirs(d + '/outbox', exist_ok=True); {plant}\n" + HOSTILE_GUEST
    )
    spec = NodeSpec(
        run_id="run1",
        node_id="node1",
        argv=["true"],
        outputs_dir=tmp_path / "outputs",
        output_paths=["**"],
        resources=Resources.from_quantities(memory="256Mi", cpus="1"),
    )
    with _Patched(["python3", "-c", script, base64.b64encode(tar_gz([reg("ok.txt")])).decode(), "success"]):
        outcome = drive_node(spec, conduit, gvisor)
    # The node's slot (prefect_resoluto.runtimes.slot) refuses the plant when the node ends: named, removed.
    assert not os.path.lexists(conduit.root / "run/run1/nodes/node1/outbox/a-planted.tar.gz")
    assert outcome.failure == "protocol", outcome.describe()
    assert "'outbox/a-planted.tar.gz', a symbolic link" in outcome.reason
    assert_nothing_kept(tmp_path, host, before)


# -- through the task runner: a Python task's result files --------------------------------------
def _climb_to_root(at: str, depth: int = 30) -> list[tuple[tarfile.TarInfo, None]]:
    """Links under ``at`` whose texts each stay inside, chained to reach "/": ``a`` climbs
    back to the outputs directory, ``b`` goes through it and up to the root."""
    deep = at + "/" + "/".join(f"d{i}" for i in range(depth))
    return [
        link(f"{deep}/a", "../" * (depth + at.count("/") + 1)),
        link(f"{deep}/b", "a/" + "../" * (depth + at.count("/") + 2)),
    ]


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_error_json_planted_as_a_link_to_the_hosts_environment_is_refused(gvisor, conduit, tmp_path, host):
    """``.resoluto/error.json`` -> (through the chain) ``/proc/self/environ``: today the
    host reads its own environment into the task's exception, shown in the UI."""
    chain = _climb_to_root(".resoluto/return.json")
    deep_b = chain[1][0].name
    outbox = tar_gz(
        [*chain, link(".resoluto/error.json", deep_b[len(".resoluto/") :] + "/proc/self/environ")]
    )
    victim = _victim(tmp_path, conduit)
    before = snapshot(host)
    with _Patched(hostile_command(outbox, status="failure")):
        state = victim(return_state=True)
    shown = state.result()
    assert "broke the wire protocol" in shown and "outbox rejected" in shown, shown
    assert "not a regular file extracted earlier from this archive" in shown
    environ = Path("/proc/self/environ").read_bytes().split(b"\0")
    leaked = [v for v in environ if len(v) > 12 and v.decode(errors="replace") in shown]
    assert not leaked, "the host's environment reached the task's exception"
    from support.prefect_readback import task_runs

    (tr,) = task_runs(state.state_details.flow_run_id)
    assert not [v for v in environ if len(v) > 12 and v.decode(errors="replace") in (tr.state.message or "")]
    assert snapshot(host) == before
    outputs = tmp_path / "outputs"
    assert not [p for p in outputs.rglob("*") if p.is_symlink()]


_UNIMPORTED = {"wave": "Error", "tabnanny": "NannyNag", "poplib": "error_proto", "ftplib": "Error"}


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_error_json_naming_a_module_the_host_never_imported_imports_nothing(gvisor, conduit, tmp_path):
    """Finding 8: the sandbox's word (error.json's ``module``) never makes the host import
    a module; the exception is a RemoteTaskError naming the remote type."""
    import importlib.util

    module = next((m for m in _UNIMPORTED if m not in sys.modules and importlib.util.find_spec(m)), None)
    if module is None:
        pytest.skip(f"every candidate module is already imported here: {sorted(_UNIMPORTED)}")
    name = _UNIMPORTED[module]
    record = json.dumps(
        {"type": name, "module": module, "qualname": name, "exception": True, "message": "from the sandbox"}
    ).encode()
    outbox = tar_gz([reg(".resoluto/error.json", record)])
    runner = _runner(tmp_path, conduit)

    @flow(task_runner=runner)
    def victim() -> BaseException | None:
        try:
            df.double.submit(1).result()
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    with _Patched(hostile_command(outbox, status="failure")):
        raised = victim()
    from prefect_resoluto.task_runner.call_spec import RemoteTaskError

    assert module not in sys.modules, f"the host imported {module!r} because the sandbox named it"
    assert type(raised) is RemoteTaskError, type(raised)
    assert raised.remote_type == _UNIMPORTED[module] and raised.remote_message == "from the sandbox"


def _gz_one(name: str, data: bytes) -> bytes:
    """An outbox of one file, compressed hard: a large, repetitive file costs little to send."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), 9)


def _victim(tmp_path: Path, conduit: Any) -> Any:
    """A flow of one ``df.double`` on gVisor that says what it saw of it: the exception as
    ``Type: message``, or "no error"."""

    @flow(task_runner=_runner(tmp_path, conduit))
    def victim() -> str:
        try:
            df.double.submit(1).result()
        except BaseException as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    return victim


def _what_a_task_shows(tmp_path: Path, conduit: Any, outbox: bytes) -> str:
    """What :func:`_victim` says when its sandbox hands back ``outbox`` and succeeds."""
    with _Patched(hostile_command(outbox)):
        return str(_victim(tmp_path, conduit)())


def _runner(tmp_path: Path, conduit: Any, **kw: Any) -> ResolutoTaskRunner:
    return ResolutoTaskRunner(
        runtime="gvisor",
        conduit=conduit,
        workspace=FLOWS,
        outputs_dir=tmp_path / "outputs",
        memory="256Mi",
        infrastructure_retries=0,
        warm_pool=0,
        **kw,
    )


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_an_error_json_past_its_bound_still_fails_with_the_tasks_type_and_a_cut_message(
    gvisor, conduit, tmp_path
):
    """error.json of 3 MiB, a message of brackets and a secret-free tail: the host reads its
    first MiB, and the task fails as a ValueError whose message is the start of the
    sandbox's, cut with a marker, not 3 MiB of it."""
    from prefect_resoluto.task_runner import error_file

    message = "[" * (3 * 1024 * 1024)
    record = json.dumps(
        {
            "type": "ValueError",
            "module": "builtins",
            "qualname": "ValueError",
            "exception": True,
            "message": message,
        }
    ).encode()
    outbox = _gz_one(".resoluto/error.json", record)

    @flow(task_runner=_runner(tmp_path, conduit))
    def victim() -> BaseException | None:
        try:
            df.double.submit(1).result()
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    with _Patched(hostile_command(outbox, status="failure")):
        raised = victim()
    assert isinstance(raised, ValueError), type(raised)
    text = str(raised)
    assert len(text) <= error_file.MAX_MESSAGE, f"the host's exception holds {len(text)} characters"
    assert text.startswith("[[[[") and text.endswith("from the sandbox is over 1048576 bytes]"), text[-200:]


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_return_json_of_many_empty_objects_is_refused_before_it_is_parsed(gvisor, conduit, tmp_path):
    """return.json of 16 MiB of ``{},`` (well inside the 256 Mi node's allowance, a few KiB
    gzipped) would be ~280 MiB of Python dicts in the flow process: it is refused, with
    what to do instead, before it is parsed."""
    import resource

    size = 16 * 1024 * 1024
    outbox = _gz_one(".resoluto/return.json", b'{"value": [' + b"{}," * (size // 3) + b"{}]}")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shown = _what_a_task_shows(tmp_path, conduit, outbox)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert "arrays and objects" in shown and "return the file's path" in shown, shown[:500]
    assert grown_mib < 3 * 16, f"16 MiB of return.json grew the flow process by {grown_mib:.0f} MiB"


_ESCAPED_QUOTES = b'"' + b'\\"[' * 760_000  # 2.3 MB: an unclosed string of escaped quotes and brackets

_COST_CHECK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_CPU, (60, 60))  # a hang guard, far above the ~0.1 s it takes
from prefect_resoluto.task_runner import json_cost
raw = sys.stdin.buffer.read()
json_cost.check(raw, "return.json")
print("checked", json_cost.containers(raw))
"""


def test_the_cost_check_of_a_document_of_escaped_quotes_is_linear():
    """The check before parsing skipped strings with a pattern sought again from every quote
    inside an unclosed one: 2.3 MB of escaped quotes and brackets took hours of the flow
    process's CPU, holding the GIL (every heartbeat and log stream stopped). Run in a child
    with a CPU limit: stuck, it is killed and this fails."""
    proc = subprocess.run(
        [sys.executable, "-c", _COST_CHECK], input=_ESCAPED_QUOTES, capture_output=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip() == b"checked 0", proc.stderr[-2000:]


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_return_json_of_escaped_quotes_fails_the_task_clearly(gvisor, conduit, tmp_path):
    """The same 2.3 MB document through a task: refused as malformed, at once."""
    shown = _what_a_task_shows(tmp_path, conduit, _gz_one(".resoluto/return.json", _ESCAPED_QUOTES))
    assert shown.startswith("WireError: .resoluto/return.json from the sandbox is malformed"), shown[:300]


def test_output_limit_is_one_setting_on_runner_options_block_and_cli(tmp_path):
    """Prefect glue only: ``output_limit`` reaches the node from every place settings come
    from, and without it the allowance is ``disk``, else the memory limit."""
    from prefect_resoluto import sandbox_options
    from prefect_resoluto.blocks import SandboxBlock
    from prefect_resoluto.cli import build_parser
    from prefect_resoluto.cli.plan import plan_node
    from prefect_resoluto.node.spec import NodeSpecError, output_allowance
    from prefect_resoluto.settings.config import SandboxConfig

    cfg = SandboxConfig().replace(**ResolutoTaskRunner(output_limit="1Gi")._options)
    assert cfg.output_limit_bytes == 1 << 30
    assert output_allowance(cfg.output_limit_bytes, cfg.resources) == (1 << 30, "the output_limit setting")
    assert output_allowance(None, SandboxConfig(disk="2Gi").resources) == (2 << 30, "the node's disk setting")
    assert output_allowance(None, SandboxConfig().resources) == (4 << 30, "the node's memory limit")
    with sandbox_options(output_limit="5Mi"):
        pass
    with pytest.raises(ValueError):
        ResolutoTaskRunner(output_limit="lots")
    assert SandboxBlock(output_limit="3Gi").to_config().output_limit == "3Gi"
    args = build_parser().parse_args(
        ["run", "--runtime", "process", "--min-isolation", "none", "--output-limit", "7Mi", "--", "true"]
    )
    assert plan_node(args).spec.output_limit == 7 << 20
    with pytest.raises(NodeSpecError, match="output_limit"):
        NodeSpec(run_id="r", node_id="n", argv=["true"], output_limit=0).validate()


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
@pytest.mark.parametrize(
    "value",
    [
        b'{"$resoluto": "os.system", "v": "touch /tmp/pwned"}',
        b'{"$resoluto": "tuple", "v": {"not": "a list"}}',
        b'{"$resoluto": "set", "v": [[1], [2]]}',
        b'{"$resoluto": "bytes", "v": "%%%"}',
        # 50 bytes that int() -- pydantic, for the task's `-> int` -- took minutes and GiBs to make
        b'{"$resoluto": "decimal", "v": "1e99999999"}',
        # distinct ints of one hash (not randomised): each insertion walks every one before it
        json.dumps({"$resoluto": "set", "v": [5 + i * (2**61 - 1) for i in range(4000)]}).encode(),
    ],
    ids=[
        "a-class-by-name",
        "tuple-of-an-object",
        "unhashable-set",
        "bad-base64",
        "decimal-bomb",
        "hash-flood",
    ],
)
def test_a_return_value_with_a_forged_type_tag_fails_the_task_clearly(gvisor, conduit, tmp_path, value):
    """return.json's values carry type tags (guest_runner.values). A sandbox that names a
    type of its choosing, or fills a tag with what its type cannot hold, gets a task that
    fails saying so: nothing is looked up by the name it sent."""
    outbox = _gz_one(".resoluto/return.json", b'{"value": [1, ' + value + b"]}")
    shown = _what_a_task_shows(tmp_path, conduit, outbox)
    assert shown.startswith("WireError: .resoluto/return.json from the sandbox is malformed"), shown
    assert "$resoluto" in shown or "tagged" in shown, shown


_STATE_SECRET = "st4te-s3cret-value-0123456789"
_STATE_PIN = "8675309123456789"


@pytest.mark.prefect
@pytest.mark.sandbox
@pytest.mark.usefixtures("prefect")
def test_a_forged_returned_state_or_exception_ends_the_task_only_as_a_task_may_end(gvisor, conduit, tmp_path):
    """return.json may hold the state the task returned to end in, and exceptions and
    objects as values (guest_runner.exc_values, call_spec._returned_object). A sandbox that forges them gets one of the four ends a task
    may return (any other type fails the task clearly), texts bounded, its message
    redacted, and exceptions that are values: never a KeyboardInterrupt the flow's read
    would raise, never a class from a module the host had not imported."""
    import sys
    import types

    def obj(ref: dict, data: Any) -> dict:
        return {"$resoluto": "object", "v": {"class": ref, "v": data}}

    def exc_with(message: Any) -> dict:
        rec = {"type": "ValueError", "module": "builtins", "qualname": "ValueError", "message": message}
        return {"$resoluto": "exception", "v": rec}

    def exc(type_: str, module: str, exception: bool = True) -> dict:
        rec = {"type": type_, "module": module, "qualname": type_, "exception": exception, "message": "m"}
        return {"$resoluto": "exception", "v": rec}

    cases: dict[str, Any] = {
        "running": {"state": {"type": "RUNNING"}},
        "name-not-text": {"state": {"type": "COMPLETED", "name": ["x"]}},
        "secret-in-message": {"state": {"type": "FAILED", "message": f"token {_STATE_SECRET} here"}},
        "huge": {"state": {"type": "COMPLETED", "name": "N" * 10_000, "message": "m" * 200_000}},
        "interrupt": {"state": {"type": "FAILED", "value": exc("KeyboardInterrupt", "builtins", False)}},
        "unimported": {"value": exc("Thing", "antigravity")},
        "not-a-record": {"value": {"$resoluto": "exception", "v": "text"}},
        # objects name their class: only the user's own (the task's module, the workspace's)
        # is built, never one from elsewhere, nor anything of the task's module but a
        # model, a dataclass or an enum
        "object-elsewhere": {
            "value": obj({"module": "subprocess", "qualname": "CompletedProcess"}, {"args": "x"})
        },
        "object-a-function": {
            "value": obj({"module": "m", "qualname": "double", "task_module": True}, {"x": 1})
        },
        "object-not-a-record": {"value": {"$resoluto": "object", "v": ["text"]}},
        # a package's lazy __getattr__ (prefect's imports a submodule for a name) is never asked
        "lazy-module": {"value": exc("Anything", "resoluto_test_lazy")},
        # a class whose __init_subclass__ refuses the host's mixing in: still a plain failure
        "refusing-subclass": {"value": exc("NoSuchResource", "referencing.exceptions")},
        # secrets wherever a text comes from: a name, a message cut at its bound, an
        # exception message that is a path, a set, an object's key or a number
        "secret-in-name": {"state": {"type": "COMPLETED", "name": f"done {_STATE_SECRET}"}},
        "secret-at-the-cut": {"state": {"type": "FAILED", "message": "A" * (64 * 1024 - 10) + _STATE_SECRET}},
        "secret-as-a-path": {
            "state": {"type": "FAILED", "value": exc_with({"$resoluto": "path", "v": _STATE_SECRET})}
        },
        "secret-in-a-set": {
            "state": {"type": "FAILED", "value": exc_with({"$resoluto": "set", "v": [_STATE_SECRET]})}
        },
        "secret-as-a-key": {"state": {"type": "FAILED", "value": exc_with({_STATE_SECRET: 1})}},
        "secret-as-a-number": {"state": {"type": "FAILED", "value": exc_with(int(_STATE_PIN))}},
        # ... and in what the host says of a malformed file: a tag's kind, a date, a state's type
        "secret-as-a-kind": {"value": {"$resoluto": _STATE_SECRET, "v": 1}},
        "secret-as-a-date": {"value": {"$resoluto": "datetime", "v": _STATE_SECRET}},
        "secret-as-a-type": {"state": {"type": _STATE_SECRET}},
        # a frozen attrs exception refuses the attributes the host's rebuilt one carries
        "frozen-class": {"value": exc("Unresolvable", "referencing.exceptions")},
    }
    asked: list[str] = []
    lazy = types.ModuleType("resoluto_test_lazy")
    lazy.__getattr__ = lambda name: asked.append(name)  # type: ignore[method-assign]
    sys.modules["resoluto_test_lazy"] = lazy

    import referencing.exceptions  # noqa: F401  (loaded: its class can be found)

    @flow(task_runner=_runner(tmp_path, conduit, secret_env={"API_TOKEN": _STATE_SECRET, "PIN": _STATE_PIN}))
    def victim() -> tuple:
        state = df.double.submit(1, return_state=True)
        try:
            shown: Any = state.result()
        except BaseException as e:  # noqa: BLE001
            shown = e
        return state.type.value, state.name, state.message, shown

    ends = {}
    for name, record in cases.items():
        with _Patched(hostile_command(_gz_one(".resoluto/return.json", json.dumps(record).encode()))):
            ends[name] = victim()

    for name in ("object-elsewhere", "object-a-function"):
        kind, _, _, shown = ends[name]
        assert kind == "COMPLETED" and type(shown) is dict, ends[name]
    for name in ("running", "name-not-text", "not-a-record", "object-not-a-record"):
        kind, _, message, shown = ends[name]
        assert kind == "FAILED" and "return.json from the sandbox is malformed" in message, ends[name]
    assert "'RUNNING'" in ends["running"][2]
    kind, _, message, shown = ends["secret-in-message"]
    assert kind == "FAILED" and _STATE_SECRET not in message and message.startswith("token "), ends[name]
    assert _STATE_SECRET not in repr(shown)
    kind, state_name, message, _ = ends["huge"]
    assert kind == "COMPLETED" and len(state_name) == 200 and len(message) <= 64 * 1024
    kind, _, _, shown = ends["interrupt"]
    assert kind == "FAILED" and isinstance(shown, Exception) and "KeyboardInterrupt" in repr(shown), ends[
        "interrupt"
    ]
    assert asked == [] and type(ends["lazy-module"][3]).__name__ == "RemoteTaskError", ends["lazy-module"]
    for name in ("refusing-subclass", "frozen-class"):
        kind, _, _, shown = ends[name]
        assert kind == "COMPLETED" and type(shown).__name__ == "RemoteTaskError", ends[name]
    for name in ("secret-as-a-kind", "secret-as-a-date", "secret-as-a-type"):
        assert ends[name][0] == "FAILED" and "malformed" in ends[name][2], ends[name]
    for name in [n for n in ends if n.startswith("secret-")]:
        kind, state_name, message, shown = ends[name]
        seen = f"{state_name} {message} {shown!r} {shown}"
        assert _STATE_SECRET not in seen and _STATE_PIN not in seen, (name, seen[-300:])
    assert ends["secret-in-name"][1] == "done ***"
    kind, _, _, shown = ends["unimported"]
    assert kind == "COMPLETED" and type(shown).__name__ == "RemoteTaskError", ends["unimported"]
    assert "antigravity" not in sys.modules
