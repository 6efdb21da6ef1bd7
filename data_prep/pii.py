"""PII redaction: e-mail addresses, phone numbers and public IP addresses.

Matches are replaced with placeholders (<EMAIL>, <PHONE>, <IP_ADDRESS>) and counted per
kind. Private, loopback and documentation-free addresses (10.x, 192.168.x, 127.x, ...)
are left alone: in code and docs they are configuration, not personal data; strings that
merely look like IPs are rejected by `ipaddress`, and dotted versions named as such
("v1.2.3.4", "version 2.0.1.5") are not addresses.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from data_prep.config import PIIConfig

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
# +CC (area) local, US (555) 123-4567, 555-123-4567, +44 20 7946 0958; needs separators so
# plain long numbers (ids, timestamps) do not match.
PHONE = re.compile(
    r"(?<![\w.+-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w-])"
)
# not part of a longer dotted number; a sentence's full stop after the address is fine
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?!\d|\.\d)")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}(?![\w:])")


_VERSION_CONTEXT = re.compile(r"(?:\bv|\bversion\s*|\bver\.?\s*)$", re.IGNORECASE)


def _public_ip(match: re.Match[str]) -> bool:
    """A globally routable address, unless the text calls it a version ("v1.2.3.4", "version 2.0.1.5", "ver. 3.1.4.1")."""
    if _VERSION_CONTEXT.search(match.string, max(0, match.start() - 12), match.start()):
        return False
    try:
        return ipaddress.ip_address(match.group(0)).is_global
    except ValueError:
        return False


def redact(text: str, cfg: PIIConfig) -> tuple[str, Counter[str]]:
    """(redacted text, counts per kind)."""
    counts: Counter[str] = Counter()

    def sub(pattern: re.Pattern[str], placeholder: str, kind: str, text: str, keep=lambda m: True) -> str:  # type: ignore[no-untyped-def]
        def replace(match: re.Match[str]) -> str:
            if not keep(match):
                return match.group(0)
            counts[kind] += 1
            return placeholder

        return pattern.sub(replace, text)

    if cfg.email:
        text = sub(EMAIL, "<EMAIL>", "email", text)
    if cfg.ip:
        text = sub(IPV4, "<IP_ADDRESS>", "ip", text, _public_ip)
        text = sub(IPV6, "<IP_ADDRESS>", "ip", text, _public_ip)
    if cfg.phone:
        text = sub(PHONE, "<PHONE>", "phone", text)
    return text, counts
