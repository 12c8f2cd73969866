"""Which URLs a batch webhook may call: checked when the batch is submitted (the API) and again
at each delivery (the worker), since a host name may resolve elsewhere by then. At delivery the
name is resolved once (`vetted_addresses`), every address it resolves to is checked, and the
worker connects to one of those checked addresses, never resolving the name again: an answer
that changes between the check and the connection (DNS rebinding) cannot lead it elsewhere.

STRUCTSPEC_WEBHOOK_HOSTS lists host names and IP addresses, comma-separated; `*` allows any
host whose addresses are all public. An address that is not public (loopback, private,
link-local such as a cloud's metadata service at 169.254.169.254, reserved, multicast,
unspecified) is called only when it, or the URL's host name, is listed explicitly: `*` never
reaches it. A URL with white space or control characters can never be delivered, so it is
refused as well.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def allowed_hosts(setting: str) -> set[str]:
    return {h.strip().lower() for h in setting.split(",") if h.strip()}


def url_problem(url: str, hosts_setting: str) -> str | None:
    """Why `url` may not be a webhook under `hosts_setting` (None: it may), without DNS: a
    host name is resolved at delivery (`vetted_addresses`)."""
    allowed = allowed_hosts(hosts_setting)
    if not allowed:
        return "webhooks are off on this server (STRUCTSPEC_WEBHOOK_HOSTS names the hosts they may call)"
    if url != url.strip() or any(ord(c) < 0x21 or c == "\x7f" for c in url):
        return "webhook_url must not hold spaces, tabs, line breaks or other control characters"
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as e:
        return f"webhook_url is not a valid URL: {e}"
    if parts.scheme not in ("http", "https") or not host:
        return "webhook_url must be an http:// or https:// URL with a host"
    host = host.lower()
    if host in allowed:
        return None
    if "*" not in allowed:
        return f"webhook_url's host {host!r} is not one of STRUCTSPEC_WEBHOOK_HOSTS"
    if host == "localhost" or host.endswith(".localhost"):
        return f"webhook_url's host {host!r} is this machine; only a listed host may be (STRUCTSPEC_WEBHOOK_HOSTS)"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name: its addresses are checked at delivery
    return _address_refusal(address, host)


def vetted_addresses(url: str, hosts_setting: str) -> tuple[list[str], str | None]:
    """Resolve `url`'s host once and check every address: (the addresses, in the resolver's
    order, None) when the POST may go to any of them, else ([], why not). The caller connects
    only to these. A listed host name's addresses are not checked (the operator named it); under
    `*` every address must be public or itself listed, so one private answer refuses the URL."""
    problem = url_problem(url, hosts_setting)
    if problem is not None:
        return [], problem
    parts = urlsplit(url)
    host = parts.hostname.lower()
    try:
        name = ascii_host(host)
        infos = socket.getaddrinfo(name, parts.port or (443 if parts.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return [], f"webhook host {host!r} does not resolve: {e}"
    listed = allowed_hosts(hosts_setting)
    addresses: list[str] = []
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if host not in listed and str(address) not in listed and (refusal := _address_refusal(address, host)):
            return [], refusal
        if str(address) not in addresses:
            addresses.append(str(address))
    if not addresses:
        return [], f"webhook host {host!r} does not resolve: no address"
    return addresses, None


def ascii_host(host: str) -> str:
    """A host name as DNS, TLS (SNI) and the Host header carry it: IDNA, ASCII."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return host.encode("idna").decode("ascii")


def _address_refusal(address: ipaddress.IPv4Address | ipaddress.IPv6Address, host: str) -> str | None:
    if getattr(address, "ipv4_mapped", None):
        address = address.ipv4_mapped
    if address.is_global and not address.is_multicast:
        return None
    kind = ("loopback" if address.is_loopback else "link-local" if address.is_link_local
            else "private" if address.is_private else "not public")
    shown = host if host == str(address) else f"{host!r} ({address})"
    return (f"webhook_url's address {shown} is {kind}; such an address is called only when listed in "
            "STRUCTSPEC_WEBHOOK_HOSTS by itself, not through *")
