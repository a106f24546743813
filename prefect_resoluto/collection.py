"""What the ``prefect.collections`` entry point loads: the blocks and the worker type.

Prefect imports this module to find block types (a local server registers them on
start) and worker types (``prefect work-pool create --type resoluto``, ``prefect worker
start``); both register themselves on import.
"""

from prefect_resoluto.blocks import LocalConduitBlock, S3ConduitBlock, SandboxBlock
from prefect_resoluto.worker.worker import ResolutoWorker

__all__ = ["LocalConduitBlock", "ResolutoWorker", "S3ConduitBlock", "SandboxBlock"]
