"""``python -m guest_runner``: run one node as described by the RESOLUTO_* environment."""

import sys

from guest_runner.runner import main

if __name__ == "__main__":
    sys.exit(main())
