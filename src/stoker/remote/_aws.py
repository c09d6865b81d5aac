"""Credentials and endpoints of ``s3://`` stores, as the AWS tools read them.

The keys ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
then the profile ``AWS_PROFILE`` (default ``default``) of ``~/.aws/credentials``
and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``); the
region from ``AWS_REGION``, ``AWS_DEFAULT_REGION`` or the profile; the endpoint
from ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or the profile's ``endpoint_url``.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["NO_CREDENTIALS_HINT", "aws_options", "has_s3_credentials", "true"]

NO_CREDENTIALS_HINT = (
    "give them as the AWS tools read them (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and "
    "~/.aws/credentials), or as storage_options={'access_key_id': ..., 'secret_access_key': ...}; a public bucket "
    "is read with storage_options={'skip_signature': True}"
)


def _profile(path: Path, section: str) -> dict[str, str]:
    parser = configparser.RawConfigParser()
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return {}
    return dict(parser[section]) if parser.has_section(section) else {}


def aws_options(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """obstore's S3 configuration from the environment and the AWS profile, as the AWS CLI reads them.

    Returns:
        A dict with some of ``access_key_id``, ``secret_access_key``,
        ``session_token``, ``region``, ``endpoint``.
    """
    env = os.environ if environ is None else environ
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME", "~")).expanduser()
    credentials = _profile(Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials").expanduser(), name)
    config = _profile(
        Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config").expanduser(), name if name == "default" else f"profile {name}"
    )
    profile = {**config, **credentials}
    out: dict[str, str] = {}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        out["access_key_id"] = env["AWS_ACCESS_KEY_ID"]
        out["secret_access_key"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            out["session_token"] = env["AWS_SESSION_TOKEN"]
    elif profile.get("aws_access_key_id") and profile.get("aws_secret_access_key"):
        out["access_key_id"] = profile["aws_access_key_id"]
        out["secret_access_key"] = profile["aws_secret_access_key"]
        if profile.get("aws_session_token"):
            out["session_token"] = profile["aws_session_token"]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region")
    if region:
        out["region"] = region
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or profile.get("endpoint_url")
    if endpoint:
        out["endpoint"] = endpoint
    return out


def true(value: object) -> bool:
    """Whether an option or environment value says yes (``1``, ``true``, ``yes``, ``on``)."""
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def has_s3_credentials(config: Mapping[str, Any], environ: Mapping[str, str]) -> bool:
    """Whether credentials other than the instance-metadata service's are at hand (or none are needed)."""
    if config.get("access_key_id") and config.get("secret_access_key"):
        return True
    if true(config.get("skip_signature", environ.get("AWS_SKIP_SIGNATURE", ""))) or config.get("credential_provider"):
        return True
    if environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") and environ.get("AWS_ROLE_ARN"):  # Kubernetes (IRSA)
        return True
    return bool(environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"))  # ECS
