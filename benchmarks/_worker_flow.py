"""The flow both workers run in the worker benchmark: as little as a flow run can be."""

from prefect import flow


@flow
def trivial() -> int:
    return 1
