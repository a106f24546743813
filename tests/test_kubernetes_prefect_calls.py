"""Prefect calls inside a task that runs as a Kubernetes pod (issue 40): the artifacts it makes
land on its task run and flow run, its allowed variables and blocks read as on a thread, and a
read it is not allowed fails at once with gVisor's ``PrefectAPIUnavailable`` and words. One
pod on the genuine apiserver with the tests' node agent, against the session's Prefect API;
the same task on threads and on gVisor is the reference."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flows import pod_call_flows as pcf  # noqa: E402
from support.k8s_cluster import Cluster  # noqa: E402
from support.k8s_node_agent import NodeAgent  # noqa: E402
from support.polling import wait_for  # noqa: E402
from support.prefect_readback import artifacts_of, task_runs  # noqa: E402
from test_kubernetes_cluster import STORE_SECRET, make_runtime, names, store_secret  # noqa: E402

from guest_runner.conduit import LocalConduit  # noqa: E402
from prefect_resoluto import ResolutoTaskRunner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLOWS = Path(pcf.__file__).parent
SECRET = "pod-read-secret-4471"


def shown(artifact: Any) -> tuple[Any, ...]:
    """What the UI shows of an artifact: key, type, description, data (rows parsed)."""
    data = artifact.data
    if artifact.type == "table" and isinstance(data, str):
        data = json.loads(data)
    return (artifact.key, artifact.type, artifact.description, json.dumps(data, sort_keys=True))


def run(task_runner: Any, names_: dict[str, str]) -> tuple[dict[str, Any], list[tuple[Any, ...]], list[str]]:
    """The task's answer, its task run's artifacts (each also on the flow run), its logs."""
    from prefect import flow
    from test_drop_in import logs

    @flow(task_runner=task_runner)
    def calling() -> dict[str, Any]:
        return pcf.calls.submit(names_["variable"], names_["block"], names_["refused"]).result()

    state = calling(return_state=True)
    assert state.is_completed(), state
    fr = state.state_details.flow_run_id
    (tr,) = task_runs(fr)
    arts = sorted(artifacts_of(tr.id), key=lambda a: a.created)
    assert all(str(a.flow_run_id) == str(fr) for a in arts), "on the task's flow run"
    return state.result(), [shown(a) for a in arts], [r.message for r in logs(flow_run_id=fr)]


@pytest.fixture
def reads() -> dict[str, str]:
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    tag = uuid.uuid4().hex[:8]
    made = {"variable": f"pod_region_{tag}", "block": f"pod-token-{tag}", "refused": f"pod_private_{tag}"}
    Variable.set(made["variable"], "eu-west-9")
    Variable.set(made["refused"], "private-value-3391")
    Secret(value=SECRET).save(made["block"])
    return made


@pytest.mark.k8s
@pytest.mark.sandbox
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect")
def test_a_pods_task_relays_artifacts_reads_allowed_variables_and_blocks_and_is_refused_as_on_gvisor(
    k8s_cluster: Cluster,
    k8s_ns: str,
    k8s_agent: NodeAgent,
    s3_conduit: Any,
    gvisor: Any,
    reads: dict[str, str],
    tmp_path: Path,
) -> None:
    from prefect.task_runners import ThreadPoolTaskRunner

    allowed = {"allowed_variables": [reads["variable"]], "allowed_blocks": [f"secret/{reads['block']}"]}
    store_secret(k8s_cluster, k8s_ns)
    pod = make_runtime(
        k8s_cluster,
        k8s_ns,
        guest_source="bundle",
        store_credentials_secret=STORE_SECRET,
        store_egress_cidr=None,
        store_egress_port=None,
    )
    common = {"workspace": FLOWS, **allowed}
    in_pod = ResolutoTaskRunner(
        runtime=pod, conduit=s3_conduit, min_isolation="user-kernel", outputs_dir=tmp_path / "pod", **common
    )
    on_gvisor = ResolutoTaskRunner(
        runtime="gvisor",
        conduit=LocalConduit(tmp_path / "conduit"),
        min_isolation="user-kernel",
        outputs_dir=tmp_path / "gvisor",
        **common,
    )
    threads, thread_artifacts, _ = run(ThreadPoolTaskRunner(), reads)
    local, local_artifacts, _ = run(on_gvisor, reads)
    answer, artifacts, lines = run(in_pod, reads)

    assert answer == local, (answer, local)
    assert answer["variable"] == threads["variable"] == "eu-west-9"
    assert answer["secret"] == threads["secret"] == SECRET
    assert answer["refused"] == {
        "type": "PrefectAPIUnavailable",
        "message": f"Prefect variable {reads['refused']!r} is not readable inside a sandbox: add it to "
        "allowed_variables (ResolutoTaskRunner(allowed_variables=[...]) or its sandbox block; allowed "
        f"here: {reads['variable']!r})",
    }
    assert threads["refused"] is None and threads["client"] is None  # a thread may: only a sandbox is refused
    assert answer["client"] == {
        "type": "PrefectAPIUnavailable",
        "message": "reading or changing flow runs is not available inside a sandboxed task: the task's "
        "function runs in a sandbox with no Prefect API (ResolutoTaskRunner); Prefect keeps every run's "
        "state on the host. Create artifacts with prefect.artifacts (relayed to the host), and do anything "
        "else with the API in the flow, passing what the task needs as a parameter.",
        "sends": 0,
        "sleeps": 0,
    }
    assert artifacts == local_artifacts == thread_artifacts, (artifacts, local_artifacts, thread_artifacts)
    assert [a[0] for a in artifacts] == ["pod-report", "pod-squares", "pod-progress"]
    assert "the secret is ***" in lines and not any(SECRET in m for m in lines), lines
    wait_for(lambda: names(k8s_cluster, k8s_ns, "pods") == [], timeout=60, what="the task's pod reaped")


def test_the_kubernetes_guest_image_brings_the_hosts_prefect() -> None:
    """The pod above runs the node agent's emulated image (this machine's interpreter, with
    Prefect). The image a cluster pulls is images/Dockerfile's: it must bring Prefect too, at the
    host's version, or a task's `from prefect.artifacts import ...` fails in the pod where it
    works on gVisor (and a worker's flow run has no engine to run)."""
    import re

    import prefect

    dockerfile = (ROOT / "images" / "Dockerfile").read_text()
    (pinned,) = re.findall(r"^ARG PREFECT_VERSION=(\S+)$", dockerfile, re.M)
    assert pinned == prefect.__version__, (pinned, prefect.__version__)
    (install,) = [line for line in dockerfile.splitlines() if line.startswith("RUN python -m pip install")]
    assert '"prefect==${PREFECT_VERSION}"' in install, install
