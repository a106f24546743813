"""``python -m guest_runner``: run one node as described by the RESOLUTO_* environment
(a warm pod's guest, :mod:`guest_runner.warmpod`, when the pod was started ahead of its node)."""

import os

from guest_runner.runner import exit_now, main

if __name__ == "__main__":
    if os.environ.get("RESOLUTO_WARM_POD_PREFIX"):
        from guest_runner import warmpod

        exit_now(warmpod.main())
    exit_now(main())
