"""Short-lived store credentials for one node: STS AssumeRole with a session policy of its prefix.

Shared by the remote runtimes (Kubernetes, Solari ``direct``) whose guests reach S3 themselves:
the credentials they get can read and write only the node's own keys (plus named read-only
objects, e.g. the run's guest bundle) and expire on their own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefect_resoluto.runtimes.base import LaunchError


def session_policy(bucket: str, prefix: str, read_only_keys: Sequence[str] = ()) -> str:
    """The IAM session policy: get/put under ``prefix/``, list only that prefix, get the read-only keys."""
    statements: list[dict[str, Any]] = [
        {
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject"],
            "Resource": [f"arn:aws:s3:::{bucket}/{prefix}/*"],
        },
        {
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{bucket}"],
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/*", prefix]}},
        },
    ]
    if read_only_keys:
        statements.append(
            {
                "Effect": "Allow",
                "Action": ["s3:GetObject"],
                "Resource": [f"arn:aws:s3:::{bucket}/{k}" for k in read_only_keys],
            }
        )
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def mint_node_credentials(
    *,
    role_arn: str | None,
    bucket: str,
    prefix: str,
    session_name: str,
    ttl_s: int,
    sts_endpoint: str | None = None,
    region: str | None = None,
    read_only_keys: Sequence[str] = (),
) -> dict[str, str]:
    """``AWS_*`` variables of credentials scoped by :func:`session_policy`; LaunchError when STS refuses."""
    import boto3

    policy = session_policy(bucket, prefix, read_only_keys)
    sts = boto3.client("sts", endpoint_url=sts_endpoint or None, region_name=region or None)
    try:
        out = sts.assume_role(
            RoleArn=role_arn, RoleSessionName=session_name[:64], Policy=policy, DurationSeconds=ttl_s
        )
    except Exception as e:
        raise LaunchError(
            f"cannot mint short-lived store credentials by assuming {role_arn!r}: {type(e).__name__}: {e}"
        ) from e
    finally:
        sts.close()
    c = out["Credentials"]
    return {
        "AWS_ACCESS_KEY_ID": c["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": c["SecretAccessKey"],
        "AWS_SESSION_TOKEN": c["SessionToken"],
    }
