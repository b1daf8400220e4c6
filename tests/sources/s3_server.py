"""A real S3-compatible server on loopback for the s3:// tests: moto in server mode, in its own process,
with request signing enforced (`INITIAL_NO_AUTH_ACTION_COUNT`: the first IAM calls that create the
test user run unsigned, every later request must carry that user's key). MinIO, built from the Go
module proxy, would be closer to production but takes too long to build on this shared 2-core machine.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.procs import ManagedProcess, free_port

# The unsigned calls: create_user, put_user_policy, create_access_key.
_NUM_SETUP_ACTIONS = 3
_ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


@dataclass(frozen=True)
class S3Server:
    url: str
    access_key_id: str
    secret_access_key: str

    def env(self) -> dict[str, str]:
        """The variables a `corral` process reads to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": "us-east-1",
        }

    def client(self, **overrides: str) -> Any:
        import boto3

        keys = {"aws_access_key_id": self.access_key_id, "aws_secret_access_key": self.secret_access_key}
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", **{**keys, **overrides})

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> None:
        client = self.client()
        if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
            client.create_bucket(Bucket=bucket)
        for path in sorted(directory.iterdir()):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


@contextmanager
def moto_s3(log_dir: Path) -> Iterator[S3Server]:
    import boto3

    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(_NUM_SETUP_ACTIONS), "AWS_DEFAULT_REGION": "us-east-1"}
    with ManagedProcess(argv, port, name="moto", health_path="/moto-api/", log_dir=log_dir, env=env) as proc:
        proc.wait_ready(60.0)
        iam = boto3.client(
            "iam", endpoint_url=proc.url, region_name="us-east-1",
            aws_access_key_id="setup", aws_secret_access_key="setup",
        )  # fmt: skip
        iam.create_user(UserName="corral")
        iam.put_user_policy(UserName="corral", PolicyName="s3", PolicyDocument=json.dumps(_ALLOW_S3))
        key = iam.create_access_key(UserName="corral")["AccessKey"]
        yield S3Server(proc.url, key["AccessKeyId"], key["SecretAccessKey"])
