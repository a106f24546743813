"""guest_runner.call and the prefect stand-ins, run as the sandbox runs them (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.guest import ROOT


def run_call(
    ws: Path, spec: dict, *, real_prefect: bool = False, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, dict | None, dict | None]:
    (ws / ".resoluto").mkdir(parents=True, exist_ok=True)
    (ws / ".resoluto" / "call.json").write_text(json.dumps({**spec, "real_prefect": real_prefect}))
    proc = subprocess.run(
        [sys.executable, "-m", "guest_runner.call", ".resoluto/call.json"],
        cwd=str(ws),
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    ret = ws / ".resoluto" / "return.json"
    err = ws / ".resoluto" / "error.json"
    return (
        proc,
        json.loads(ret.read_text()) if ret.exists() else None,
        json.loads(err.read_text()) if err.exists() else None,
    )


TASKS = textwrap.dedent("""
    import sys
    from prefect import task, flow, get_run_logger
    from prefect_resoluto import ResolutoTaskRunner

    @task(retries=3)
    def add(a: int, b: int = 1) -> int:
        get_run_logger().warning("adding %s and %s", a, b)
        print("prefect loaded:", type(sys.modules["prefect"]).__name__ != "_LazyModule")
        return a + b

    @task
    async def later(x):
        return x * 2

    @task
    def star(*args, **kwargs):
        return [list(args), kwargs]

    @task
    def needs_more():
        import prefect.logging  # a submodule: the real package loads transparently
        from prefect import __version__
        return __version__

    @flow(task_runner=ResolutoTaskRunner(runtime="gvisor"))
    def my_flow():
        add(1)

    if __name__ == "__main__":
        raise SystemExit("the main block must not run in the sandbox")
""")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text(TASKS)
    return tmp_path


def test_a_task_module_runs_without_importing_prefect(ws):
    proc, ret, err = run_call(ws, {"file": "tasks.py", "qualname": "add", "parameters": {"a": 2}})
    assert err is None and ret == {"value": 3}, proc.stderr
    assert "prefect loaded: False" in proc.stdout
    marker = [
        json.loads(line.split(":", 1)[1])
        for line in proc.stdout.split("\n")
        if line.startswith("\x1eresoluto-log:")
    ]
    assert marker == [{"level": "WARNING", "logger": "prefect.task_runs", "msg": "adding 2 and 1"}]


def test_a_call_leaves_no_bytecode_in_its_workspace(ws):
    (ws / "pkg").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    (ws / "uses.py").write_text(
        "import os, sys\nfrom prefect import task\nfrom pkg.helper import twice\n\n"
        "@task\ndef run(x):\n    return [twice(x), sys.dont_write_bytecode]\n"
    )
    proc, ret, err = run_call(ws, {"file": "uses.py", "qualname": "run", "parameters": {"x": 4}})
    assert err is None and ret == {"value": [8, True]}, proc.stderr
    assert sorted(str(p.relative_to(ws)) for p in ws.rglob("__pycache__")) == []


def test_async_and_var_args_and_real_prefect_on_demand(ws):
    _, ret, _ = run_call(ws, {"file": "tasks.py", "qualname": "later", "parameters": {"x": 21}})
    assert ret == {"value": 42}
    _, ret, _ = run_call(
        ws, {"file": "tasks.py", "qualname": "star", "parameters": {"args": [1, 2], "kwargs": {"k": 3}}}
    )
    assert ret == {"value": [[1, 2], {"k": 3}]}
    proc, ret, err = run_call(ws, {"file": "tasks.py", "qualname": "needs_more", "parameters": {}})
    assert err is None, err
    import prefect

    assert ret == {"value": prefect.__version__}


def test_real_prefect_mode_still_has_a_working_run_logger(ws):
    proc, ret, err = run_call(
        ws, {"file": "tasks.py", "qualname": "add", "parameters": {"a": 1, "b": 2}}, real_prefect=True
    )
    assert err is None and ret == {"value": 3}, (err, proc.stderr)
    assert "prefect loaded: True" in proc.stdout


@pytest.mark.parametrize(
    "spec, kind, text",
    [
        (
            {"file": "nope.py", "qualname": "f", "parameters": {}},
            "CallError",
            "is not in the staged workspace",
        ),
        (
            {"file": "tasks.py", "qualname": "missing", "parameters": {}},
            "CallError",
            "'missing' not found in module 'tasks'",
        ),
        (
            {"file": "../x.py", "qualname": "f", "parameters": {}},
            "CallError",
            "must be relative to the workspace",
        ),
        (
            {"module": "no_such_module_xyz", "qualname": "f", "parameters": {}},
            "CallError",
            "install the package in the guest image",
        ),
        (
            {"file": "tasks.py", "qualname": "add", "parameters": {"zzz": 1}},
            "CallError",
            "not in the signature",
        ),
        (
            {"file": "tasks.py", "qualname": "add", "parameters": {"a": "x", "b": 1}},
            "TypeError",
            "can only concatenate str",
        ),
    ],
)
def test_failures_are_reported_in_error_json(ws, spec, kind, text):
    proc, ret, err = run_call(ws, spec)
    assert proc.returncode == 1 and ret is None
    assert err["type"] == kind and text in err["message"] + err["traceback"], err


# -- a script that calls its flow without `if __name__ == "__main__":` ---------------------------
UNGUARDED = textwrap.dedent("""
    import asyncio
    from prefect import flow, task
    from prefect_resoluto import ResolutoTaskRunner

    CALLS = []

    @task
    def work(i: int) -> int:
        CALLS.append(i)
        return len(CALLS)

    @task
    def seen() -> dict:
        # What of the module exists when the task runs: the host had run nothing past its
        # flow call when it submitted the task.
        names = [n for n in ("RESULT", "AFTER") if n in globals()]
        return {"calls": len(CALLS), "names": names}

    @task
    def runs_a_subflow() -> list:
        return pipeline()  # a subflow called by a running task runs, inline

    @flow(task_runner=ResolutoTaskRunner(runtime="gvisor"))
    def pipeline():
        return [work(i) for i in range(3)]

    @flow
    async def apipeline():
        return work(9)

    def main():
        return pipeline()

    TAIL
    AFTER = "past the flow call"
""")

#: How scripts call their flow at the bottom, unguarded.
TAILS = {
    "call": "RESULT = pipeline()",
    "async": "RESULT = asyncio.run(apipeline())",
    "main": "RESULT = main()",
    "serve": "RESULT = pipeline.serve(name='nightly')",
    "deploy": "RESULT = pipeline.deploy(name='nightly', work_pool_name='pool')",
    "swallowed": "try:\n    RESULT = pipeline()\nexcept Exception:\n    RESULT = None",
    "bare-except": "try:\n    RESULT = pipeline()\nexcept:  # noqa: E722\n    raise SystemExit(1)",
}


@pytest.mark.parametrize("real_prefect", [False, True], ids=["standin", "real"])
@pytest.mark.parametrize("tail", sorted(TAILS))
def test_an_unguarded_flow_call_is_where_the_task_modules_import_ends(tmp_path, tail, real_prefect):
    (tmp_path / "script.py").write_text(UNGUARDED.replace("TAIL", TAILS[tail]))
    proc, ret, err = run_call(
        tmp_path, {"file": "script.py", "qualname": "work", "parameters": {"i": 5}}, real_prefect=real_prefect
    )
    assert err is None and ret == {"value": 1}, (err, proc.stderr)  # no task body ran before it
    proc, ret, err = run_call(
        tmp_path, {"file": "script.py", "qualname": "seen", "parameters": {}}, real_prefect=real_prefect
    )
    assert err is None and ret == {"value": {"calls": 0, "names": []}}, (err, proc.stderr)


@pytest.mark.parametrize("real_prefect", [False, True], ids=["standin", "real"])
def test_a_subflow_a_running_task_calls_still_runs(tmp_path, real_prefect):
    (tmp_path / "script.py").write_text(UNGUARDED.replace("TAIL", TAILS["call"]))
    proc, ret, err = run_call(
        tmp_path,
        {"file": "script.py", "qualname": "runs_a_subflow", "parameters": {}},
        real_prefect=real_prefect,
    )
    assert err is None and ret == {"value": [1, 2, 3]}, (err, proc.stderr)


TWO_FLOWS = textwrap.dedent("""
    from prefect import flow, task
    import helper  # calls a flow of its own at import, unguarded

    CALLS = []

    @task
    def early() -> list:
        return ["early", helper.STATE, len(CALLS)]

    @flow
    def first():
        CALLS.append("first")
        return 3

    # Ends the import for `early`. For `late`, not defined yet, it runs, as on the host:
    # what follows may need its value.
    ROWS = first()

    @task
    def late() -> list:
        return ["late", helper.STATE, ROWS, len(CALLS)]

    @flow
    def second():
        return late()

    second()
    raise SystemExit("the import went past the flow call of the task's flow")
""")

HELPER = textwrap.dedent("""
    from prefect import flow

    @flow
    def helpers_own():
        return "imported whole"

    STATE = helpers_own()  # another module's top level: runs, as on the host
""")


@pytest.mark.parametrize("real_prefect", [False, True], ids=["standin", "real"])
@pytest.mark.parametrize(
    "qualname, value", [("early", ["early", "imported whole", 0]), ("late", ["late", "imported whole", 3, 1])]
)
def test_only_the_task_modules_own_call_after_the_task_ends_the_import(
    tmp_path, qualname, value, real_prefect
):
    (tmp_path / "two.py").write_text(TWO_FLOWS)
    (tmp_path / "helper.py").write_text(HELPER)
    proc, ret, err = run_call(
        tmp_path, {"file": "two.py", "qualname": qualname, "parameters": {}}, real_prefect=real_prefect
    )
    assert err is None and ret == {"value": value}, (err, proc.stdout, proc.stderr)
    ended = "'first'" if qualname == "early" else "'second'"
    assert f"the flow {ended} called at the top level of 'two': its import ends there" in proc.stdout


@pytest.mark.parametrize("real_prefect", [False, True], ids=["standin", "real"])
def test_serving_before_the_task_is_defined_is_skipped_and_the_import_goes_on(tmp_path, real_prefect):
    (tmp_path / "served.py").write_text(
        textwrap.dedent("""
            from prefect import flow, task

            @flow
            def nightly():
                raise SystemExit("the flow ran in the sandbox")

            SERVED = nightly.serve(name="nightly")  # would block, or reach for an API

            @task
            def after() -> list:
                return ["after", SERVED]
        """)
    )
    proc, ret, err = run_call(
        tmp_path, {"file": "served.py", "qualname": "after", "parameters": {}}, real_prefect=real_prefect
    )
    assert err is None and ret == {"value": ["after", None]}, (err, proc.stdout, proc.stderr)


def test_a_generator_task_is_told_to_return_a_list(tmp_path):
    (tmp_path / "gen.py").write_text("from prefect import task\n\n@task\ndef rows():\n    yield 1\n")
    proc, ret, err = run_call(tmp_path, {"file": "gen.py", "qualname": "rows", "parameters": {}})
    assert ret is None and err["type"] == "ResultNotSerializable", (err, proc.stderr)
    assert "the task is a generator" in err["message"] and "Return a list" in err["message"]


SIGNATURES = textwrap.dedent("""
    from prefect import task

    @task
    def shapes(a, /, b, *args, c=3, d, **kw):
        return [a, b, list(args), c, d, sorted(kw.items())]

    @task
    def positional_defaults(a, b=2, /, c=5):
        return [a, b, c]
""")


@pytest.mark.parametrize(
    "qualname, args, kwargs",
    [
        ("shapes", (1, 2, 5, 6), {"d": 4, "e": 9}),  # failed: "got multiple values for argument 'b'"
        ("shapes", (1,), {"b": 2, "d": 4}),
        ("shapes", (1, 2), {"d": 0, "c": 1}),
        ("positional_defaults", (1,), {}),
        ("positional_defaults", (1, 7), {}),
        ("positional_defaults", (1,), {"c": 9}),
    ],
)
def test_every_kind_of_parameter_is_passed_as_a_threads_task_gets_it(tmp_path, qualname, args, kwargs):
    """Positional-only parameters, ``*args`` after named ones, keyword-only ones and
    ``**kwargs``, from the parameters Prefect binds on the host: the call in the sandbox
    gets what calling the function on the host would."""
    from prefect.utilities.callables import get_call_parameters

    from guest_runner import values
    from prefect_resoluto.task_runner.call_spec import encode_parameters

    (tmp_path / "sigs.py").write_text(SIGNATURES)
    space: dict = {}
    exec(SIGNATURES, space)
    fn = space[qualname].fn
    params = encode_parameters(qualname, get_call_parameters(fn, args, kwargs))
    proc, ret, err = run_call(tmp_path, {"file": "sigs.py", "qualname": qualname, "parameters": params})
    assert err is None, (err, proc.stderr)
    assert values.loads(json.dumps(ret))["value"] == fn(*args, **kwargs)


PASSED_ON = textwrap.dedent("""
    from prefect import task

    class Needy(Exception):
        def __new__(cls, code, reason):
            return super().__new__(cls, code, reason)

    @task
    def look(error):
        return [type(error).__name__, isinstance(error, Exception), str(error), isinstance(error, Needy)]
""")


@pytest.mark.parametrize(
    "record, seen",
    [
        (
            {
                "type": "ExceptionGroup",
                "module": "builtins",
                "qualname": "ExceptionGroup",
                "message": "two (2 sub-exceptions)",
            },
            ["ExceptionGroup", True, "two (2 sub-exceptions)", False],
        ),
        (
            {
                "type": "Needy",
                "module": "__main__",
                "qualname": "Needy",
                "task_module": True,
                "message": "no",
            },
            ["Needy", True, "no", False],
        ),
        (
            {
                "type": "KeyError",
                "module": "builtins",
                "qualname": "KeyError",
                "message": "'k'",
                "args": ["k"],
            },
            ["KeyError", True, "'k'", False],
        ),
    ],
    ids=["exception-group", "a-class-whose-new-wants-arguments", "key-error"],
)
def test_an_exception_passed_on_that_its_class_cannot_remake_arrives_as_one_of_its_name(
    tmp_path, record, seen
):
    """allow_failure passes a failed upstream's exception. One whose class cannot be made
    from a message alone (an ExceptionGroup wants its exceptions; a class whose __new__
    wants arguments) failed the task with a TypeError before it ran: it arrives as an
    exception of its name and message."""
    (tmp_path / "passed.py").write_text(PASSED_ON)
    parameters = {"error": {"$resoluto": "exception", "v": record}}
    proc, ret, err = run_call(tmp_path, {"file": "passed.py", "qualname": "look", "parameters": parameters})
    assert err is None, (err, proc.stderr)
    assert ret == {"value": seen}


def test_a_returned_states_name_and_message_are_redacted_in_the_sandbox(tmp_path):
    """return.json stays in the node's outbox, the attempt's evidence: a state the task
    returned carries its name and message there redacted, as a state message is."""
    secret = "st4te-s3cret-in-the-guest-0123"
    (tmp_path / "ends.py").write_text(
        "import os\nfrom prefect import task\n\n@task\ndef end():\n"
        "    from prefect.states import Completed\n"
        "    token = os.environ['API_TOKEN']\n"
        "    return Completed(name=f'done {token}', message=f'with {token}', data=1)\n"
    )
    proc, ret, err = run_call(
        tmp_path, {"file": "ends.py", "qualname": "end", "parameters": {}}, env={"API_TOKEN": secret}
    )
    assert err is None, (err, proc.stderr)
    assert ret == {"state": {"type": "COMPLETED", "name": "done ***", "message": "with ***", "value": 1}}
