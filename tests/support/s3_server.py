"""A real S3-protocol server for the tests: moto's standalone server (`python -m moto.server`)
as a child process on a loopback port, plus the credentials it knows once authentication is on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from processes import free_port


class MotoServer:
    """moto.server on 127.0.0.1:<port>; multipart parts may be as small as 64 KiB here."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.access_key = self.secret_key = ""

    def start(self) -> None:
        env = dict(os.environ, S3_UPLOAD_PART_MIN_SIZE=str(64 << 10))
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{self.url}/moto-api/", timeout=1.0)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto.server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def env(self, **extra: str) -> dict[str, str]:
        """The AWS variables a client of this server needs (without authentication, any key)."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.access_key or "testing",
                "AWS_SECRET_ACCESS_KEY": self.secret_key or "testing", "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull, **extra}

    def client(self):
        import boto3
        env = self.env()
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])

    def create_user(self, name: str = "kvmesh-test", actions: tuple[str, ...] = ("*",)) -> tuple[str, str]:
        """An IAM user allowed `actions` on everything; its (key id, secret). The first one
        created becomes the key pair env() and client() use."""
        import boto3
        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": list(actions), "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName="allowed", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        if not self.access_key:
            self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def set_auth(self, on: bool) -> None:
        """Make the server check every request's signature and key (on) or accept any (off)."""
        httpx.post(f"{self.url}/moto-api/reset-auth", content=b"0" if on else b"inf").raise_for_status()
