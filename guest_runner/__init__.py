"""The guest side of prefect-resoluto: runs inside the sandbox.

Standard library only (boto3 only for an S3 conduit), Python 3.9+, so any image with a
Python interpreter can run it: ``python -m guest_runner``.
"""

__version__ = "0.1.0"
