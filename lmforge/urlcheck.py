"""Credentials never travel in a URL lmforge is given (`workspace`, an endpoint, a tracking URI).

A config is logged, tracked in MLflow, published as Prefect artifacts and kept in manifests and
step keys, so a URL in it must hold no secret: no `user:password@` and no secret-like query
parameter (a presigned S3 or GCS signature, an Azure SAS `sig`, `?key=`, `?token=` ...). Credentials
come from each service's own chain (environment, profile, instance role, an `*_env` variable).
The refusal never repeats the secret: it names the field and the URL without its user part and
query. Written by hand: this is a policy over `urllib.parse`'s parts, not a parser.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

# in every refusal of a credential (here and runtime.storage.options): the config's error line
# (lmforge.config) recognises it and never repeats the value given
REFUSED = "credentials never go in the config"

SECRET_QUERY = re.compile(
    r"^(sig|signature|token|access_token|refresh_token|id_token|auth|authorization|api[-_]?key|key|"
    r"password|passwd|pwd|secret|client_secret|credential|credentials|sas|sas_token|"
    r"x-amz-(signature|credential|security-token)|x-goog-(signature|credential))$",
    re.IGNORECASE,
)


def redacted(url: str) -> str:
    """The URL without its user part and query: safe to print."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{host}{parts.path}" if parts.scheme else url.split("?", 1)[0]


def credential_in(url: str) -> str | None:
    """What in `url` is a credential ('a user name or password', 'the query parameter ...'), or None."""
    if "://" not in url:
        return None
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "a user name or password before '@'"
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if SECRET_QUERY.match(name.strip()):
            return f"the query parameter {name.strip()[:40]!r}"
    return None


def refuse_credentials(url: str | None, field: str) -> str | None:
    """Raise ValueError (one line) when `url` carries a credential; else return it unchanged."""
    if url is None:
        return url
    found = credential_in(url)
    if found:
        raise ValueError(
            f"{field} {redacted(url)}: the URL carries a credential ({found}); {REFUSED} (it is logged, "
            "tracked and kept in manifests): use the service's own chain or an *_env variable"
        )
    return url
