#!/usr/bin/env bash
# Smoke test of the kubernetes runtime on a real cluster (Kata or gVisor RuntimeClass).
#
# Checks, in order, and stops at the first failure with what to fix:
#   1. kubectl, the pinned context, the namespace, the RuntimeClass, the store Secret;
#   2. RBAC: every verb on every resource the runtime uses (kubectl auth can-i);
#   3. the rendered NetworkPolicy/Secret/Pod pass the API server's own validation
#      (server-side dry run, nothing is created);
#   4. one node end to end: workspace in, command in a pod, events, result, outputs back;
#   5. the NetworkPolicy is enforced: the cloud metadata address is unreachable from a pod;
#   6. nothing is left behind in the namespace.
#
# Needs (environment):
#   RESOLUTO_SANDBOX_KUBECONTEXT   the kube context to use (required: never the ambient one)
#   RESOLUTO_SANDBOX_IMAGE         an image with python3 >= 3.9 and boto3 (images/Dockerfile)
#   RESOLUTO_STORE_BUCKET          an existing bucket reachable from this host and the pods
#   RESOLUTO_STORE_ENDPOINT        S3-compatible endpoint (omit for AWS S3), reachable from pods
#   RESOLUTO_STORE_REGION          optional, default us-east-1
#   RESOLUTO_STORE_SECRET          Secret in the namespace with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY
#                                  for the pods (default: resoluto-store)
#   AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or a profile) for this host's access to the bucket
# Optional:
#   RESOLUTO_SANDBOX_NAMESPACE     default resoluto-sandboxes
#   RESOLUTO_SANDBOX_RUNTIME_CLASS default kata
#   RESOLUTO_STORE_EGRESS_CIDR/_PORT  where pods reach the store when it differs from the endpoint
#   PYTHON                         interpreter with prefect-resoluto installed (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
NS=${RESOLUTO_SANDBOX_NAMESPACE:-resoluto-sandboxes}
RC=${RESOLUTO_SANDBOX_RUNTIME_CLASS:-kata}
SECRET=${RESOLUTO_STORE_SECRET:-resoluto-store}
CTX=${RESOLUTO_SANDBOX_KUBECONTEXT:-}

say() { printf '\n== %s\n' "$*"; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

say "1. cluster, namespace, RuntimeClass, store Secret"
command -v kubectl >/dev/null || die "kubectl is not on PATH"
[ -x "$PY" ] || command -v "$PY" >/dev/null || die "no Python at $PY (set PYTHON=)"
[ -n "$CTX" ] || die "set RESOLUTO_SANDBOX_KUBECONTEXT to the context of the cluster to test"
[ -n "${RESOLUTO_SANDBOX_IMAGE:-}" ] || die "set RESOLUTO_SANDBOX_IMAGE (an image with python3 + boto3)"
[ -n "${RESOLUTO_STORE_BUCKET:-}" ] || die "set RESOLUTO_STORE_BUCKET"
K=(kubectl --context "$CTX")
"${K[@]}" version >/dev/null || die "cannot reach the API server of context $CTX"
"${K[@]}" get namespace "$NS" >/dev/null || die "namespace $NS is missing: kubectl --context $CTX create namespace $NS"
"${K[@]}" get runtimeclass "$RC" >/dev/null || die "RuntimeClass $RC is missing (see docs/backends.md, 'Kata')"
"${K[@]}" -n "$NS" get secret "$SECRET" >/dev/null || die "Secret $SECRET is missing in $NS: kubectl -n $NS create secret generic $SECRET --from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=..."
echo "ok: context $CTX, namespace $NS, RuntimeClass $RC, Secret $SECRET"

say "2. RBAC"
missing=0
for check in "create pods" "get pods" "list pods" "delete pods" "get pods/log" \
             "create networkpolicies.networking.k8s.io" "get networkpolicies.networking.k8s.io" \
             "list networkpolicies.networking.k8s.io" "delete networkpolicies.networking.k8s.io" \
             "patch networkpolicies.networking.k8s.io" \
             "create secrets" "get secrets" "list secrets" "delete secrets" "patch secrets"; do
  # shellcheck disable=SC2086
  if ! "${K[@]}" -n "$NS" auth can-i $check >/dev/null 2>&1; then
    echo "missing: $check"; missing=1
  fi
done
[ "$missing" = 0 ] || die "grant the verbs above (docs/backends.md has a Role)"
echo "ok: every verb the runtime uses is allowed"

export RESOLUTO_SANDBOX_NAMESPACE="$NS" RESOLUTO_SANDBOX_RUNTIME_CLASS="$RC" RESOLUTO_STORE_SECRET="$SECRET"
export RESOLUTO_SANDBOX_KUBECONTEXT="$CTX"

say "3. rendered manifests pass the API server's validation (server-side dry run)"
"$PY" - <<'PYEOF' | "${K[@]}" apply --dry-run=server -f - >/dev/null || die "the API server rejected the rendered objects (above)"
import os
from prefect_resoluto.runtimes.kubernetes.render import render_yaml
from prefect_resoluto.runtimes.base import LaunchSpec, Resources
from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime

env = {
    "RESOLUTO_STORE_KIND": "s3", "RESOLUTO_STORE_BUCKET": os.environ["RESOLUTO_STORE_BUCKET"],
    "RESOLUTO_STORE_REGION": os.environ.get("RESOLUTO_STORE_REGION", "us-east-1"),
    "RESOLUTO_RUN_ID": "smoke-render", "RESOLUTO_NODE_ID": "n1",
    "RESOLUTO_WORKLOAD_ARGV": '["true"]', "RESOLUTO_WORKSPACE_DIR": "/workspace",
}
if os.environ.get("RESOLUTO_STORE_ENDPOINT"):
    env["RESOLUTO_STORE_ENDPOINT"] = os.environ["RESOLUTO_STORE_ENDPOINT"]
rt = KubernetesRuntime(runtime_class=os.environ["RESOLUTO_SANDBOX_RUNTIME_CLASS"],
                       store_credentials_secret=os.environ["RESOLUTO_STORE_SECRET"])
spec = LaunchSpec(sandbox_id="smoke-render", env=env, secret_env={"SMOKE_TOKEN": "x"},
                  resources=Resources.from_quantities(memory="512Mi", cpus="0.5", disk="1Gi"))
print(render_yaml(spec, rt))
PYEOF
echo "ok: NetworkPolicy, Secret and Pod are valid for this cluster"

say "4+5. one node end to end, then the metadata address from inside a pod"
"$PY" - <<'PYEOF' || die "the end-to-end node failed (above); kubectl -n $NS get events may say more"
import os
import sys
import tempfile
import uuid
from pathlib import Path

from guest_runner.conduit.s3 import S3Conduit
from prefect_resoluto.node.drive import NodeSpec, drive_node
from prefect_resoluto.runtimes.kubernetes import KubernetesRuntime

conduit = S3Conduit(os.environ["RESOLUTO_STORE_BUCKET"], base_prefix="resoluto-smoke",
                    endpoint_url=os.environ.get("RESOLUTO_STORE_ENDPOINT") or None,
                    region=os.environ.get("RESOLUTO_STORE_REGION") or None)
rt = KubernetesRuntime(runtime_class=os.environ["RESOLUTO_SANDBOX_RUNTIME_CLASS"],
                       store_credentials_secret=os.environ["RESOLUTO_STORE_SECRET"],
                       unschedulable_patience_s=120)
run_id = f"smoke-{uuid.uuid4().hex[:12]}"
rt.prepare(conduit, run_id)
ws = Path(tempfile.mkdtemp())
(ws / "in.txt").write_text("hello from the host\n")

def show(ev):
    line = (ev.get("data") or {}).get("line")
    if line:
        print("   |", line)

code = ("import pathlib, platform; print(pathlib.Path('in.txt').read_text().strip(), '->', platform.release()); "
        "pathlib.Path('out.txt').write_text('hello from the pod')")
out = drive_node(NodeSpec(run_id=run_id, node_id="n1", argv=["python3", "-c", code], workspace=ws,
                          output_paths=["out.txt"]), conduit, rt, on_event=show, min_isolation=rt.isolation)
print("   outcome:", out.describe())
if not out.ok or (out.output_dir / "out.txt").read_text() != "hello from the pod":
    sys.exit("end-to-end node failed")
print("ok: inbox, pod, events, result and outbox all worked")

# Not in the allowlist: the cloud metadata endpoint, and a public HTTPS address (which
# also proves enforcement on clusters without a metadata service, if they have internet).
probe = ("import socket, sys\n"
         "bad = 0\n"
         "for host, port in (('169.254.169.254', 80), ('1.1.1.1', 443)):\n"
         "    s = socket.socket(); s.settimeout(3)\n"
         "    try:\n        s.connect((host, port)); print(host, 'REACHABLE'); bad = 1\n"
         "    except OSError as e:\n        print(host, 'unreachable:', e)\n"
         "    finally:\n        s.close()\n"
         "sys.exit(bad)\n")
out = drive_node(NodeSpec(run_id=run_id, node_id="n2", argv=["python3", "-c", probe]), conduit, rt,
                 on_event=show, min_isolation=rt.isolation)
if not out.ok:
    sys.exit("a pod reached an address outside its allowlist: the NetworkPolicy is not enforced -- install a "
             "NetworkPolicy-enforcing CNI (docs/backends.md)")
print("ok: the egress policy is enforced")
conduit.delete_prefix(f"run/{run_id}/")
PYEOF

say "6. nothing left behind"
left=$("${K[@]}" -n "$NS" get pods,networkpolicies,secrets -l app.kubernetes.io/managed-by=prefect-resoluto -o name)
[ -z "$left" ] || die "left behind in $NS: $left"
echo "ok: no pods, policies or secrets of prefect-resoluto remain"
say "smoke test passed"
