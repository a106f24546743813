"""The suite's process-wide setup, and its plugins: fixtures, tiers and scheduling live in
tests/support/ (docs/testing.md)."""

from __future__ import annotations

import os
import signal

# Nothing may leave this machine: Prefect's server would try to send usage telemetry, and
# every subprocess a test starts inherits this.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"

# A suite started in the background by a non-interactive shell (`cmd &`, nohup) inherits
# SIGINT as ignored, and so would every flow, worker and sandbox a test starts: the tests
# of Ctrl-C and of stopping a worker would then wait on processes that cannot hear them.
# Python's own handler makes it default again in each child (exec resets a handler, not an
# ignore).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# An xdist worker starts with COLUMNS=80 LINES=24 set (execnet's pipe is no terminal); every
# program a test starts would take them over its own terminal's size. Not the suite's own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        if os.environ.get(_name) in ("80", "24"):
            os.environ.pop(_name, None)

pytest_plugins = [
    "support.fixtures",  # state isolation, schemas, the Prefect API, gVisor, a local conduit
    "support.s3_fixtures",  # the S3 endpoint (moto behind a counting, faulting proxy)
    "support.gateway_server",  # one auth'd Prefect server and worker for the gateway's modules
    "support.k8s_cluster",  # the genuine kube-apiserver and its node agent
    "support.tiers",  # each test's tier markers, checked against the fixtures it uses
    "support.scheduling",  # units of work for the two xdist workers; background builds
]
