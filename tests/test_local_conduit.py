"""LocalConduit: atomic, root-confined, listing in key order with start_after."""

from __future__ import annotations

import os
import threading

import pytest
from support.conduit_contract import ConduitContract

from guest_runner.conduit import (
    Conduit,
    ConduitError,
    ConduitUnavailable,
    InvalidKey,
    LocalConduit,
    ObjectNotFound,
)
from guest_runner.conduit.registry import conduit_from_env, conduit_from_url


def test_put_get_list_delete(local_conduit):
    c = local_conduit
    c.put("run/r/nodes/n/events-000002.jsonl", b"2")
    c.put("run/r/nodes/n/events-000001.jsonl", b"1")
    c.put("run/r/nodes/n/inbox/workspace.tar.gz", b"w")
    c.put("run/r/nodes/n2/result.json", b"{}")
    assert c.get("run/r/nodes/n/events-000001.jsonl") == b"1"
    assert c.list_prefix("run/r/nodes/n/") == [
        "run/r/nodes/n/events-000001.jsonl",
        "run/r/nodes/n/events-000002.jsonl",
        "run/r/nodes/n/inbox/workspace.tar.gz",
    ]
    # a key prefix, not only a directory
    assert c.list_prefix("run/r/nodes/n/events-") == [
        "run/r/nodes/n/events-000001.jsonl",
        "run/r/nodes/n/events-000002.jsonl",
    ]
    assert c.list_prefix("run/r/nodes/n/", start_after="run/r/nodes/n/events-000001.jsonl") == [
        "run/r/nodes/n/events-000002.jsonl",
        "run/r/nodes/n/inbox/workspace.tar.gz",
    ]
    assert c.list_prefix("run/none/") == []
    assert c.delete_prefix("run/r/nodes/n/") == 3
    assert c.list_prefix("run/r/") == ["run/r/nodes/n2/result.json"]


def test_missing_key_is_not_an_outage(local_conduit, tmp_path):
    with pytest.raises(ObjectNotFound, match="no object 'nope'") as exc:
        local_conduit.get("nope")
    assert not isinstance(exc.value, ConduitUnavailable)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConduitUnavailable):
        LocalConduit(blocker / "sub")
    ro = LocalConduit(tmp_path / "ro")
    (tmp_path / "ro").chmod(0o500)
    try:
        import os

        if os.geteuid() != 0:  # root ignores directory permissions
            with pytest.raises(ConduitUnavailable):
                ro.put("a/b", b"x")
    finally:
        (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", "", "a//b", "a/./b"])
def test_keys_escaping_the_root_are_refused(local_conduit, key):
    with pytest.raises(InvalidKey):
        local_conduit.put(key, b"x")
    assert isinstance(InvalidKey("x"), ConduitError)


def test_symlink_inside_root_cannot_lead_outside(local_conduit, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (local_conduit.root / "link").symlink_to(outside)
    with pytest.raises(InvalidKey, match="escapes"):
        local_conduit.put("link/x", b"x")
    assert not (outside / "x").exists()


def test_a_put_or_a_listing_never_goes_through_a_link_even_one_inside_the_root(local_conduit):
    # A sandbox owns its node's directory: a link it plants there to another node's must not
    # make the host write that node's objects (or list them as this node's).
    c = local_conduit
    c.put("run/r/nodes/other/result.json", b"theirs")
    (c.root / "run/r/nodes/mine").mkdir(parents=True)
    (c.root / "run/r/nodes/mine/inbox").symlink_to(c.root / "run/r/nodes/other")
    with pytest.raises(InvalidKey):
        c.put("run/r/nodes/mine/inbox/result.json", b"forged")
    assert c.get("run/r/nodes/other/result.json") == b"theirs"
    assert c.list_prefix("run/r/nodes/mine/inbox/") == []
    (c.root / "run/r/nodes/mine/file").write_text("x")
    with pytest.raises(InvalidKey):  # a file where a directory should be: refused too
        c.put("run/r/nodes/mine/file/obj", b"x")
    assert sorted(p.name for p in (c.root / "run/r/nodes/other").iterdir()) == ["result.json"]


def test_a_listing_of_a_tree_deeper_than_the_bound_is_a_clear_error_not_a_crash(local_conduit):
    c = local_conduit
    fd = os.open(c.root, os.O_RDONLY)
    try:
        for part in ["run", "r", "nodes", "a", *(["d"] * 70)]:  # past the bound, a recursion's way
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = os.open(part, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    c.put("run/r/nodes/a/shallow.txt", b"x")
    assert c.list_prefix("run/r/nodes/a/", shallow=True) == ["run/r/nodes/a/shallow.txt"]
    with pytest.raises(ConduitUnavailable, match="deeper than"):
        c.list_prefix("run/r/nodes/a/")


def test_a_listing_racing_a_directory_swapped_for_a_fifo_or_a_link_never_blocks(local_conduit, tmp_path):
    # The sandbox swaps a directory of its node with a FIFO (and with a link out of the root)
    # while the host lists the node: the listing neither blocks on the FIFO nor enters the link.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    c = local_conduit
    node = c.root / "run/r/nodes/a"
    (node / "sub").mkdir(parents=True)
    (node / "sub" / "inner.txt").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s")
    os.mkfifo(node / "fifo")
    (node / "link").symlink_to(outside)
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        at = -100  # AT_FDCWD
        pairs = [(node / "sub", node / "fifo"), (node / "sub", node / "link")]
        while not stop.is_set():
            for a, b in pairs:
                libc.renameat2(at, bytes(a), at, bytes(b), 2)  # RENAME_EXCHANGE
                swaps[0] += 1

    seen: set[str] = set()
    errors: list[BaseException] = []

    def lister() -> None:
        try:
            for _ in range(3000):
                seen.update(c.list_prefix("run/r/nodes/a/"))
        except BaseException as e:  # the test's point: anything but keys
            errors.append(e)

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    reader = threading.Thread(target=lister, daemon=True)
    reader.start()
    reader.join(timeout=120)  # a hang detector for ms-long calls, not a synchronisation
    stop.set()
    t.join()
    assert not reader.is_alive(), "a listing blocked"
    assert errors == []
    assert swaps[0] > 0
    assert not any("secret" in k for k in seen), seen
    assert seen <= {
        "run/r/nodes/a/" + k
        for k in ("fifo", "link", "sub", "sub/inner.txt", "fifo/inner.txt", "link/inner.txt")
    }


def test_delete_prefix_removes_a_link_not_what_it_points_to(local_conduit):
    c = local_conduit
    c.put("run/r/nodes/b/result.json", b"theirs")
    c.put("run/r/nodes/a/mine.txt", b"mine")
    (c.root / "run/r/nodes/a/evil").symlink_to(c.root / "run/r/nodes/b/result.json")
    (c.root / "run/r/nodes/a/evildir").symlink_to(c.root / "run/r/nodes/b")
    c.delete_prefix("run/r/nodes/a/")
    assert c.get("run/r/nodes/b/result.json") == b"theirs"
    assert not os.path.lexists(c.root / "run/r/nodes/a/evil")
    assert not os.path.lexists(c.root / "run/r/nodes/a/mine.txt")


def test_readers_never_see_partial_objects_or_temp_files(local_conduit):
    """A reader hammering list+get while a writer replaces a 4 MiB object sees only whole objects."""
    c = local_conduit
    a, b = b"a" * (4 << 20), b"b" * (4 << 20)
    c.put("obj", a)
    done = threading.Event()
    bad: list[str] = []

    def reader():
        while not done.is_set():
            for key in c.list_prefix(""):
                if key != "obj":
                    bad.append(key)
            data = c.get("obj")
            if data not in (a, b):
                bad.append(f"partial object of {len(data)} bytes")

    t = threading.Thread(target=reader)
    t.start()
    for i in range(30):
        c.put("obj", a if i % 2 else b)
    done.set()
    t.join()
    assert bad == []


def test_urls_and_env_round_trip(tmp_path):
    c = conduit_from_url((tmp_path / "c").as_uri())
    assert isinstance(c, LocalConduit) and c.root == tmp_path / "c"
    assert conduit_from_url(c.url).root == c.root
    env = c.guest_env()
    assert env == {"RESOLUTO_STORE_KIND": "localfs", "RESOLUTO_STORE_ROOT": str(tmp_path / "c")}
    assert conduit_from_env(env).root == c.root
    for bad in ("ftp://x", "file://host/x", "s3://", "relative/dir"):
        with pytest.raises(ValueError):
            conduit_from_url(bad)
    with pytest.raises(ValueError, match="RESOLUTO_STORE_KIND"):
        conduit_from_env({"RESOLUTO_STORE_KIND": "gcs"})
    with pytest.raises(ValueError, match="RESOLUTO_STORE_ROOT"):
        conduit_from_env({"RESOLUTO_STORE_KIND": "localfs"})


def test_get_stream_reads_in_pieces_and_never_follows_a_planted_link_or_fifo(local_conduit, tmp_path):
    """The guest writes its node's directory: an object that is a link (to a host file, or
    to another node's object inside the root), a FIFO (which would block an open), or
    sits under a directory link, is "no object", never read through or waited on."""
    import os

    big = os.urandom(3 << 20)
    local_conduit.put("run/r/nodes/n/outbox/output.tar.gz", big)
    with local_conduit.get_stream("run/r/nodes/n/outbox/output.tar.gz") as f:
        assert f.read(1 << 20) == big[: 1 << 20] and f.read() == big[1 << 20 :]
    secret = tmp_path / "host-secret"
    secret.write_text("host")
    node = local_conduit.root / "run/r/nodes/n"
    (node / "outbox" / "to-host.tar.gz").symlink_to(secret)
    (node / "outbox" / "to-other.tar.gz").symlink_to(node / "outbox" / "output.tar.gz")
    os.mkfifo(node / "outbox" / "fifo.tar.gz")
    (node / "linked").symlink_to(node / "outbox")
    for key in ("to-host.tar.gz", "to-other.tar.gz", "fifo.tar.gz"):
        for read in (local_conduit.get_stream, local_conduit.get):
            with pytest.raises(ObjectNotFound, match="no object"):
                read(f"run/r/nodes/n/outbox/{key}")
    with pytest.raises(ObjectNotFound):
        local_conduit.get("run/r/nodes/n/linked/output.tar.gz")
    with pytest.raises(ObjectNotFound):
        local_conduit.get_stream("run/r/nodes/n/outbox/absent.tar.gz")


def test_reads_by_name_from_an_opened_directory_refuse_what_get_stream_refuses(local_conduit, tmp_path):
    """The host's tail opens its node's directory once and each object by name from it
    (issue 42): a link, a FIFO, a name that is a path, or a directory that is a link on the way
    there are refused as they are on the walk from the root."""
    import os

    local_conduit.put("run/r/nodes/n/events-000001.jsonl", b"mine")
    secret = tmp_path / "host-secret"
    secret.write_text("host")
    node = local_conduit.root / "run/r/nodes/n"
    (node / "to-host.jsonl").symlink_to(secret)
    os.mkfifo(node / "fifo.jsonl")
    (local_conduit.root / "run/r/nodes/linked").symlink_to(node)
    fd = local_conduit.open_dir("run/r/nodes/n")
    try:
        with local_conduit.get_stream_at(fd, "events-000001.jsonl", "k") as f:
            assert f.read() == b"mine"
        for name in ("to-host.jsonl", "fifo.jsonl", "absent.jsonl"):
            with pytest.raises(ObjectNotFound, match="no object"):
                local_conduit.get_stream_at(fd, name, name)
        for name in ("../n/events-000001.jsonl", "..", ".", "", "a\x00b"):
            with pytest.raises(InvalidKey):
                local_conduit.get_stream_at(fd, name, name)
    finally:
        os.close(fd)
    with pytest.raises(ObjectNotFound):
        local_conduit.open_dir("run/r/nodes/linked")  # a directory link on the way is not followed
    with pytest.raises(ObjectNotFound):
        local_conduit.open_dir("run/r/nodes/n/events-000001.jsonl")  # a file, not a directory
    with pytest.raises(InvalidKey):
        local_conduit.open_dir("../escape")


class TestLocalConduitContract(ConduitContract):
    @pytest.fixture
    def conduit(self, local_conduit: LocalConduit) -> Conduit:
        return local_conduit


def test_a_directory_the_host_may_not_enter_is_the_conduits_error_not_a_raw_one():
    """A sandbox of the host's own user (bubblewrap, gVisor) can chmod its node's directories:
    the host's reads of them fail as conduit errors. Run as an unprivileged user (root ignores
    the mode): a child that imports as root, then drops to nobody."""
    import shutil
    import subprocess
    import sys
    import tempfile

    root = tempfile.mkdtemp(prefix="resoluto-eacces-", dir="/tmp")  # nobody reaches it
    os.chmod(root, 0o777)
    code = f"""
import os
from guest_runner.conduit import ConduitError, LocalConduit
os.setresgid(65534, 65534, 65534)
os.setgroups([])
os.setresuid(65534, 65534, 65534)
c = LocalConduit({root!r})
c.put("run/r/nodes/n/sub/x", b"x")
os.chmod({root!r} + "/run/r/nodes/n/sub", 0)
for what, call in [
    ("get", lambda: c.get("run/r/nodes/n/sub/x")),
    ("open_dir", lambda: c.open_dir("run/r/nodes/n/sub")),
    ("put", lambda: c.put("run/r/nodes/n/sub/y", b"y")),
    ("list", lambda: c.list_prefix("run/r/nodes/n/")),
    ("delete", lambda: c.delete_prefix("run/r/nodes/n/")),
]:
    try:
        call()
        print(what, "ok")
    except ConduitError as e:
        print(what, "conduit-error")
    except Exception as e:
        print(what, "RAW", type(e).__name__)
os.chmod({root!r} + "/run/r/nodes/n/sub", 0o700)
"""
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    assert "RAW" not in res.stdout, res.stdout
    assert "get conduit-error" in res.stdout and "open_dir conduit-error" in res.stdout, res.stdout


@pytest.mark.parametrize(
    "umask, parent, leaf", [(0, 0o755, 0o700), (0o022, 0o755, 0o700), (0o077, 0o700, 0o700)]
)
def test_make_dirs_gives_every_directory_it_makes_its_own_mode_less_the_umask(tmp_path, umask, parent, leaf):
    """Never writable by others under umask 0 (``Path.mkdir(parents=True)`` made the parents
    0777 there); a stricter umask still takes its bits; what exists is left as it is."""
    from guest_runner.conduit.local import make_dirs

    (tmp_path / "kept").mkdir(mode=0o750)
    os.chmod(tmp_path / "kept", 0o750)
    old = os.umask(umask)
    try:
        make_dirs(tmp_path / "kept" / "a" / "b" / "c", 0o700)
        make_dirs(tmp_path / "kept" / "a" / "b" / "c", 0o700)  # there already: nothing to do
    finally:
        os.umask(old)
    modes = [(tmp_path / p).stat().st_mode & 0o7777 for p in ("kept", "kept/a", "kept/a/b", "kept/a/b/c")]
    assert modes == [0o750, parent, parent, leaf]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        make_dirs(tmp_path / "file" / "d")
