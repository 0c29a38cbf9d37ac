"""Where the service listens: ``[HOST:]PORT``, loopback by default, and the rule that a
non-loopback address needs an API key. (No web stack imported: the CLI checks flags with it.)"""
from __future__ import annotations

import ipaddress

from kernels.errors import FormatError

DEFAULT_HOST = "127.0.0.1"
API_KEY_ENV = "COLI_API_KEY"
PULL_KEY_ENV = "COLI_PULL_KEY"  # the bearer key a server sends the peers it pulls sessions from


def parse_bind(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (``[::1]:PORT`` for IPv6) as (host, port); port 0 asks the OS for one."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else DEFAULT_HOST
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise FormatError(f"--http {text!r}: expected [HOST:]PORT with a port in [0, 65535]")
    return host or DEFAULT_HOST, int(port)


def is_loopback_address(text: str | None) -> bool:
    """Whether ``text`` is a loopback IP address literal (IPv4-mapped IPv6 included); a name, an
    empty string or None is not an address, so never loopback. A peer's address is judged by this."""
    if not text:
        return False
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def is_loopback_host(host: str) -> bool:
    """Whether listening on ``host`` stays on this machine: the name ``localhost`` or a loopback
    address (:func:`is_loopback_address`)."""
    return host == "localhost" or is_loopback_address(host)


def check_bind(host: str, api_key: str | None) -> None:
    """A non-loopback address is refused without an API key."""
    if not is_loopback_host(host) and not api_key:
        raise FormatError(f"refusing to listen on {host} (not loopback) without an API key: pass --api-key KEY "
                          f"or set {API_KEY_ENV}")


__all__ = ["API_KEY_ENV", "DEFAULT_HOST", "PULL_KEY_ENV", "check_bind", "is_loopback_address", "is_loopback_host",
           "parse_bind"]
