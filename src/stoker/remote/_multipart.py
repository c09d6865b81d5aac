"""S3's multipart uploads in progress: listed (``ListMultipartUploads``) and aborted (``AbortMultipartUpload``).

obstore uploads a large file in parts, but does not list the uploads in
progress nor abort one it did not finish (a writer killed outright, or a
request dropped by Ctrl-C): their parts stay in the bucket, billed, until a
lifecycle rule or an abort removes them. These two requests are made here,
signed with AWS Signature Version 4 (the standard library's ``hmac`` and
``hashlib``) with the credentials, region and endpoint of the store's own
configuration, over ``http.client``.

Only what the store's configuration holds is used: a store whose credentials
come from elsewhere (the instance-metadata service, a web identity, a
credential provider) cannot make these requests (:class:`Unsigned`). Google
Cloud Storage and Azure are not served here: Azure drops uncommitted blocks by
itself after 7 days; GCS needs a lifecycle rule.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

__all__ = ["MultipartClient", "Unsigned", "Upload"]

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: one request's bound [seconds] (these are small requests; the store's retry policy retries a timeout)
_TIMEOUT = 60.0


class Unsigned(Exception):
    """The store's configuration holds no credentials to sign these requests with (they come from elsewhere)."""


class S3RequestError(Exception):
    """A request answered with an error status: the text holds ``status code: N`` and S3's ``<Code>``, as obstore's do."""


@dataclass(frozen=True)
class Upload:
    """One multipart upload in progress: the key relative to the store's prefix, its id, when it was started."""

    key: str
    upload_id: str
    initiated: datetime.datetime


def _query(query: Mapping[str, str]) -> str:
    """The canonical query string: keys sorted, keys and values percent-encoded (``uploads`` -> ``uploads=``)."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))


def _true(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


class MultipartClient:
    """Signed ``ListMultipartUploads`` and ``AbortMultipartUpload`` requests for one S3 prefix.

    Args:
        config: obstore's S3 configuration of the store (``S3Store.config``):
            ``bucket``, ``access_key_id``, ``secret_access_key``,
            ``session_token``, ``region``, ``endpoint``, ``virtual_hosted_style_request``.
        prefix: the store's prefix in the bucket (``S3Store.prefix``), or ``None``.

    Raises:
        Unsigned: the configuration holds no access key and secret.
    """

    def __init__(self, config: Mapping[str, Any], prefix: str | None) -> None:
        self.access_key = str(config.get("access_key_id") or "")
        self.secret = str(config.get("secret_access_key") or "")
        if not self.access_key or not self.secret:
            raise Unsigned("no access key in the store's configuration")
        self.token = str(config.get("session_token") or config.get("token") or "")
        self.region = str(config.get("region") or "us-east-1")
        self.bucket = str(config["bucket"])
        self.prefix = (prefix.strip("/") + "/") if prefix and prefix.strip("/") else ""
        endpoint = str(config.get("endpoint") or f"https://s3.{self.region}.amazonaws.com").rstrip("/")
        if _true(config.get("virtual_hosted_style_request", False)):
            if not config.get("endpoint"):
                endpoint = f"https://{self.bucket}.s3.{self.region}.amazonaws.com"
            base = ""  # (the endpoint names the bucket)
        else:
            base = "/" + quote(self.bucket, safe="")
        parts = urlsplit(endpoint)
        self.scheme = parts.scheme or "https"
        self.host = parts.netloc
        self.path = parts.path.rstrip("/") + base

    # ---- the requests ----------------------------------------------------------------------------------
    def list(self, prefix: str = "") -> list[Upload]:
        """The uploads in progress whose keys (relative to the store's prefix) start with ``prefix``, every page."""
        uploads: list[Upload] = []
        markers: dict[str, str] = {}
        while True:
            query = {"uploads": "", "prefix": self.prefix + prefix, **markers}
            root = ET.fromstring(self._request("GET", self.path + "/", query))
            for node in root.iter(f"{_NS}Upload"):
                key = node.findtext(f"{_NS}Key") or ""
                upload_id = node.findtext(f"{_NS}UploadId") or ""
                when = (node.findtext(f"{_NS}Initiated") or "").replace("Z", "+00:00")
                try:
                    initiated = datetime.datetime.fromisoformat(when)
                except ValueError:
                    initiated = datetime.datetime.now(datetime.UTC)  # unknown: taken as young
                if key.startswith(self.prefix) and upload_id:
                    uploads.append(Upload(key[len(self.prefix) :], upload_id, initiated))
            if (root.findtext(f"{_NS}IsTruncated") or "").lower() != "true":
                return uploads
            markers = {
                "key-marker": root.findtext(f"{_NS}NextKeyMarker") or "",
                "upload-id-marker": root.findtext(f"{_NS}NextUploadIdMarker") or "",
            }

    def abort(self, key: str, upload_id: str) -> None:
        """Abort the upload ``upload_id`` of ``key`` (relative to the store's prefix); one already gone is no error."""
        try:
            self._request("DELETE", self.path + "/" + quote(self.prefix + key, safe="/~"), {"uploadId": upload_id})
        except S3RequestError as exc:
            if "NoSuchUpload" not in str(exc):
                raise

    # ---- signing (AWS Signature Version 4) -------------------------------------------------------------
    def sign(self, method: str, path: str, query: Mapping[str, str], now: datetime.datetime) -> dict[str, str]:
        """The headers of the request ``method path?query`` at time ``now``, signed (``Authorization`` included)."""
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        headers = {"host": self.host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
        if self.token:
            headers["x-amz-security-token"] = self.token
        names = ";".join(sorted(headers))
        canonical = "\n".join(
            [method, path, _query(query), "".join(f"{k}:{headers[k].strip()}\n" for k in sorted(headers)), names, _EMPTY_SHA256]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        key = ("AWS4" + self.secret).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, SignedHeaders={names}, Signature={signature}"
        return headers

    def _request(self, method: str, path: str, query: Mapping[str, str]) -> bytes:
        headers = self.sign(method, path, query, datetime.datetime.now(datetime.UTC))
        canonical_query = _query(query)
        target = path + ("?" + canonical_query if canonical_query else "")
        connection_type = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        connection = connection_type(self.host, timeout=_TIMEOUT)
        try:
            connection.request(method, target, headers=headers)
            response = connection.getresponse()
            body = response.read()
        finally:
            connection.close()
        if response.status >= 300:
            text = body.decode("utf-8", "replace")[:600]
            raise S3RequestError(f"{method} {'uploads' if method == 'GET' else 'abort'}: status code: {response.status}: {text}")
        return body
