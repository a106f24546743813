#!/usr/bin/env bash
# The browser pass: the same small flow (tests/flows/artifact_flows.py) under ThreadPool and under gVisor on a
# fresh `prefect server`, then screenshots of what a user sees (headless chromium, scripts/browser_shot.py):
# each flow run's Artifacts tab, the Artifacts page, a retried task run's page. Needs chromium
# (apt install chromium); docs/screenshots/browser-pass-*.png come from it.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/browser-pass}
rm -rf $OUT; mkdir -p $OUT/home $OUT/conduit $OUT/shots
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export PREFECT_HOME=$OUT/home PREFECT_API_URL=http://127.0.0.1:$PORT/api PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL=http://127.0.0.1:$PORT/api
$REPO/.venv/bin/prefect server start --host 127.0.0.1 --port $PORT > $OUT/server.log 2>&1 &
echo $! > $OUT/server.pid
for i in $(seq 1 120); do curl -sf http://127.0.0.1:$PORT/api/health >/dev/null && break; sleep 1; done
cat > $OUT/flows_run.py <<PY
import sys
sys.path.insert(0, "$REPO/tests/flows")
from pathlib import Path
import artifact_flows as af
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from prefect_resoluto import ResolutoTaskRunner

def make(name, runner):
    @flow(name=name, task_runner=runner)
    def artifact_check():
        doubled = [f.result() for f in af.double.map([1, 2, 3])]
        again = af.flaky.submit().result()
        total = af.report.submit(doubled).result()
        return doubled, again, total
    return artifact_check

which = sys.argv[1]
if which == "threads":
    st = make("browser-pass", ThreadPoolTaskRunner())(return_state=True)
else:
    st = make("browser-pass", ResolutoTaskRunner(runtime="gvisor", workspace=Path(af.__file__).parent, memory="256Mi", conduit=Path("$OUT/conduit").as_uri()))(return_state=True)
print("FLOW_RUN", st.state_details.flow_run_id, st.type)
PY
for w in threads gvisor; do (cd $OUT && $REPO/.venv/bin/python flows_run.py $w 2>&1 | tee $OUT/$w.log | grep FLOW_RUN | awk '{print $2}' > $OUT/$w.id); done
echo "http://127.0.0.1:$PORT" > $OUT/url
U=$(cat $OUT/url)
shot() { $REPO/.venv/bin/python $REPO/scripts/browser_shot.py "$@"; }
for w in threads gvisor; do shot "$U/runs/flow-run/$(cat $OUT/$w.id)" $OUT/shots/$w-flow-run-artifacts.png Artifacts 8; done
shot "$U/artifacts" $OUT/shots/artifacts-page.png "" 8
flaky=$(curl -s -X POST $U/api/task_runs/filter -H 'content-type: application/json' \
  -d "{\"flow_runs\":{\"id\":{\"any_\":[\"$(cat $OUT/gvisor.id)\"]}},\"task_runs\":{\"name\":{\"like_\":\"flaky\"}}}" |
  python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["id"])')
shot "$U/runs/task-run/$flaky" $OUT/shots/gvisor-task-run.png "" 8
shot "$U/runs/task-run/$flaky" $OUT/shots/gvisor-task-run-artifacts.png Artifacts 8
kill "$(cat $OUT/server.pid)"
echo "screenshots in $OUT/shots"
