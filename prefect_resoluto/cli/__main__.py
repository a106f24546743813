"""``python -m prefect_resoluto.cli``: the same program as ``prefect-resoluto``."""

import sys

from prefect_resoluto.cli import main

sys.exit(main())
