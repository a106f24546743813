"""``python -m guest_runner``: run one node as described by the RESOLUTO_* environment."""

from guest_runner.runner import exit_now, main

if __name__ == "__main__":
    exit_now(main())
