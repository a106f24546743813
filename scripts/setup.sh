#!/usr/bin/env bash
# One-shot set-up on a fresh Debian 12 machine: system sandboxes + a project virtualenv.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v podman >/dev/null 2>&1 || need_apt+=(podman)
command -v runc >/dev/null 2>&1 || need_apt+=(runc)
# A restored gVisor sandbox's child subreaper (podman's init; runtimes/gvisor.py).
command -v catatonit >/dev/null 2>&1 || need_apt+=(catatonit)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# Egress allowlists: nsenter/unshare start sandboxes in their namespace; the egress tests'
# test hosts use curl (a command task) and openssl (their self-signed certificate).
command -v nsenter >/dev/null 2>&1 || need_apt+=(util-linux)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)

if ! command -v runsc >/dev/null 2>&1 || [ ${#need_apt[@]} -gt 0 ]; then
  # bookworm-backports carries a runsc with the systrap platform (much cheaper syscalls
  # than ptrace). It gets its own sources file; debian.sources is left alone.
  if grep -q bookworm /etc/os-release 2>/dev/null \
     && [ ! -f /etc/apt/sources.list.d/resoluto-backports.sources ]; then
    mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/* *$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
    if [ -n "$mirror" ]; then
      $SUDO tee /etc/apt/sources.list.d/resoluto-backports.sources >/dev/null <<SRC
Types: deb
URIs: ${mirror}
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
  fi
  $SUDO apt-get update -qq
  if [ ${#need_apt[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi
  if ! command -v runsc >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports runsc >/dev/null 2>&1 \
      || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq runsc >/dev/null \
      || echo "setup: runsc (gVisor) could not be installed; the gvisor runtime will be unavailable" >&2
  fi
fi

# The genuine Kubernetes control plane for the kubernetes runtime's tests is NOT built here:
# the demo does not need it, and a cold build is 5-15 minutes on 2 cores. The test session
# builds it (cached under ~/.cache, flock'ed) in the background while the other tests run,
# and runs the tests against it last (tests/support/k8s_build.py). To build it ahead by hand:
# `bash scripts/k8s-local-cluster.sh build`.

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Exact versions from the lock (what CI tested); `bash scripts/lock.sh` refreshes it.
# The checkout goes on sys.path by a plain path line (editable_mode=compat), as an installed
# package is found: setuptools' default editable import hook costs every interpreter of this
# venv ~9 ms to start (16 vs 7 ms here) -- the guest runner and the call in every sandbox
# among them, and the bare `runsc run` the benchmarks compare a node with.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/dev.txt \
  --config-settings editable_mode=compat -e '.[dev]'
runsc_v=$(runsc --version 2>/dev/null || true); echo "setup: ready ($(.venv/bin/python --version), ${runsc_v%%$'\n'*})"

# The reference implementation, resoluto-sandbox 0.1.0 (Python >= 3.12), in its own venv for the
# wire-compatibility tests and the `reference` benchmark, from its lock; skipped where no Python 3.12 exists.
ref_py=$(bash scripts/find-python312.sh)
if [ -z "$ref_py" ]; then
  echo "setup: no Python 3.12 here; wire-compatibility tests and the reference benchmark will skip" >&2
else
  { { [ -x .venv-ref/bin/python ] || "$ref_py" -m venv .venv-ref; } \
    && .venv-ref/bin/python -m pip install -q --disable-pip-version-check -c constraints/ref.txt 'resoluto-sandbox==0.1.0'; } \
    || echo "setup: could not install resoluto-sandbox 0.1.0 into .venv-ref; its tests will skip" >&2
fi
