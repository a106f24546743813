"""A flow on gVisor whose task fetches a page from an allowlisted test host; everything
else stays denied, and the proxy's decisions are in the task run's Prefect logs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow
from support import egress_net

from guest_runner.conduit import LocalConduit
from prefect_resoluto import ResolutoTaskRunner
from prefect_resoluto.egress import CANARY_ENV, netns, proxy

pytestmark = [
    pytest.mark.prefect,
    pytest.mark.sandbox,
    pytest.mark.usefixtures("prefect"),
    pytest.mark.skipif(not netns.available().ok, reason=f"egress needs namespaces: {netns.available().why}"),
]

FLOWS = Path(__file__).parent / "flows"


@pytest.fixture
def testnet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[egress_net.TestNet]:
    net = egress_net.build(tmp_path, "fl")
    monkeypatch.setenv(proxy.UPLINK_ENV, net.uplink)
    monkeypatch.setenv(CANARY_ENV, f"{egress_net.HOST2}:7,denied.example.test:443")
    yield net
    net.close()


def test_flow_task_fetches_an_allowlisted_page_and_nothing_else(gvisor, testnet, tmp_path: Path) -> None:
    from flows.egress_flows import fetch
    from support.prefect_readback import task_runs
    from test_task_runner import logs_of

    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "ca.pem").write_bytes(testnet.cert.read_bytes())
    runner = ResolutoTaskRunner(
        runtime="gvisor",
        conduit=LocalConduit(tmp_path / "conduit"),
        workspace=FLOWS,
        outputs_dir=tmp_path / "outputs",
        egress=["api.example.test"],
        egress_resolve=testnet.resolve,
        env={"SSL_CERT_FILE": str(certs / "ca.pem")},
        runtime_options={"extra_ro_paths": [str(certs)]},
    )

    @flow(task_runner=runner)
    def reach_out() -> tuple[str, str, str]:
        ok = fetch.submit("https://api.example.test/from-a-flow")
        other = fetch.submit("https://other.example.test/not-allowed")
        imds = fetch.submit("http://169.254.169.254/latest/meta-data/")
        return ok.result(), other.result(), imds.result()

    state = reach_out(return_state=True)
    ok, other, imds = state.result()
    assert ok == f"hello from {egress_net.HOST} host=api.example.test path=/from-a-flow\n"
    assert other.startswith("ERROR") and "403" in other
    assert imds.startswith("ERROR")
    assert testnet.hits.to(egress_net.HOST2) == [] and testnet.hits.to(egress_net.IMDS) == []
    by_url: dict[str, list[tuple[str, str]]] = {}
    for tr in task_runs(state.state_details.flow_run_id):
        by_url[tr.name] = [(log.level, log.message) for log in logs_of(tr.id)]
    messages = [m for logs in by_url.values() for _, m in logs]
    assert any("egress allowed api.example.test:443 -> 198.18.0.2:443 via CONNECT" in m for m in messages)
    refusals = [
        (lvl, m)
        for logs in by_url.values()
        for lvl, m in logs
        if "egress refused other.example.test:443" in m
    ]
    assert refusals and all(lvl == 30 for lvl, _ in refusals) and "not in the allowlist" in refusals[0][1]
    assert any(
        "egress refused 169.254.169.254:80 via HTTP proxy: not in the allowlist" in m for m in messages
    )
    assert proxy.proxy_for(str(state.state_details.flow_run_id)) is None
