"""PII redaction: e-mail addresses, phone numbers and IP addresses that can point at someone.

Matches are replaced with placeholders (<EMAIL>, <PHONE>, <IP_ADDRESS>) and counted per
kind. IPv6 is matched in every written form (full, compressed `2001:db8::1`, with an
embedded IPv4 part). Addresses that identify no one are left alone: private networks
(10.x, 172.16-31.x, 192.168.x, fc00::/7), loopback, link-local, multicast, unspecified
and reserved ranges -- in code and docs they are configuration. Documentation ranges
(192.0.2.0/24, 2001:db8::/32) are redacted: in crawled text they cannot be told from real
ones. Strings that merely look like IPs are rejected by `ipaddress` (a Python slice
`x[1::2]` parses as `1::2`, which is reserved space and kept), and dotted versions named
as such ("v1.2.3.4", "version 2.0.1.5") are not addresses.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from data_prep.config import PIIConfig

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
# +CC (area) local, US (555) 123-4567, 555-123-4567, +44 20 7946 0958; needs separators so
# plain long numbers (ids, timestamps) do not match.
PHONE = re.compile(r"(?<![\w.+-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?![\w-])")
# not part of a longer dotted number; a sentence's full stop after the address is fine
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?!\d|\.\d)")
# any run of hex groups joined by colons (with at most one "::"), optionally ending in IPv4;
# `ipaddress` decides whether it is one
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:]|\.\d)")
_KEEP = [
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/8",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
]


_VERSION_CONTEXT = re.compile(r"(?:\bv|\bversion\s*|\bver\.?\s*)$", re.IGNORECASE)


def _public_ip(match: re.Match[str]) -> bool:
    """An address that may point at someone, unless the text calls it a version ("v1.2.3.4", "ver. 3.1.4.1")."""
    if _VERSION_CONTEXT.search(match.string, max(0, match.start() - 12), match.start()):
        return False
    try:
        address = ipaddress.ip_address(match.group(0))
    except ValueError:
        return False
    return not any(address.version == net.version and address in net for net in _KEEP)


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
