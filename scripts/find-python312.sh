#!/usr/bin/env bash
# Prints a working Python 3.12 for the reference implementation's venv (.venv-ref), or nothing.
# (The pyenv shim on PATH fails unless PYENV_VERSION is set, so pyenv's installs are tried too.)
for c in "$(command -v python3.12 2>/dev/null || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  if [ -n "$c" ] && [ -x "$c" ] && "$c" -S -c pass >/dev/null 2>&1; then echo "$c"; exit 0; fi
done
