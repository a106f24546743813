#!/usr/bin/env bash
# Refreshes the locks that scripts/setup.sh installs from:
#   constraints/dev.txt  the project venv (.venv): `.[dev]` and everything it pulls in
#   constraints/ref.txt  the reference implementation's venv (.venv-ref)
#   constraints/prefect-oldest.txt  the oldest Prefect minor pyproject.toml claims (.venv-oldest,
#                        scripts/prefect-range.sh), with the pins of its own dependencies it needs
# Each is resolved afresh, with pyproject.toml's ranges and no lock, into a throwaway venv made
# by the same interpreter and pip that setup.sh uses, then frozen to exact versions. Review
# the diff, run the suite (`bash scripts/setup.sh && .venv/bin/python -m pytest`), commit both.
set -euo pipefail
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip_q=(-q --disable-pip-version-check)

write_lock() {  # write_lock <venv> <file> <what it locks>
  {
    echo "# Exact versions for $3 ($("$1/bin/python" --version), $(uname -m))."
    echo "# Made by \`bash scripts/lock.sh\`; do not edit by hand (pyproject.toml keeps the ranges)."
    "$1/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check
  } >"$2"
  echo "lock: $2 ($(grep -vc '^#' "$2") packages)"
}

"${PYTHON:-python3}" -m venv "$tmp/dev"
"$tmp/dev/bin/python" -m pip install "${pip_q[@]}" -e '.[dev]'
write_lock "$tmp/dev" constraints/dev.txt "the project venv, \`pip install -c constraints/dev.txt -e '.[dev]'\`"

# The floor of pyproject.toml's prefect range, and what that Prefect needs pinned to run: FastAPI
# 0.137 rewrote its routing (every request to Prefect 3.6's server fails: `'PrefectRouter' object has
# no attribute 'routes'`), and Prefect 3.6 imports importlib_metadata without requiring it.
"${PYTHON:-python3}" -m venv "$tmp/oldest"
"$tmp/oldest/bin/python" -m pip install "${pip_q[@]}" -e '.[dev]' 'prefect==3.6.*' 'fastapi<0.137' importlib-metadata
write_lock "$tmp/oldest" constraints/prefect-oldest.txt \
  "the oldest Prefect minor claimed, \`pip install -c constraints/prefect-oldest.txt -e '.[dev]'\`"

ref_py=$(bash scripts/find-python312.sh)
if [ -z "$ref_py" ]; then
  echo "lock: no Python 3.12 here; constraints/ref.txt left as it is" >&2
else
  "$ref_py" -m venv "$tmp/ref"
  "$tmp/ref/bin/python" -m pip install "${pip_q[@]}" 'resoluto-sandbox==0.1.0'
  write_lock "$tmp/ref" constraints/ref.txt "the reference venv, \`pip install -c constraints/ref.txt resoluto-sandbox==0.1.0\`"
fi
