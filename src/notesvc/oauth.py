"""OAuth's wire rules for MCP connectors, apart from the grants they lead to (grants.py).

Its errors in OAuth's own JSON, which redirect URIs a client may register and how they
match, scopes, PKCE, the `WWW-Authenticate` challenge that points a client at the
metadata, and a client's metadata document fetched from its URL (public addresses only,
bounded)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any, Callable

from notesvc.helpers import is_loopback

OAUTH_SCOPES = ("notes:read", "notes:write")
PKCE_RE = re.compile(r"^[A-Za-z0-9._~-]{43,128}\Z")  # a verifier (RFC 7636 4.1)
CIMD_TIMEOUT, CIMD_MAX_BYTES = 5.0, 65536  # a client's metadata document: time, bytes


class OAuthError(Exception):
    """An OAuth failure, answered in OAuth's own JSON (RFC 6749 5.2, RFC 7591 3.2.2)."""

    def __init__(self, error: str, description: str, status: int = 400, headers=None):
        super().__init__(description)
        self.error, self.description, self.status = error, description, status
        self.headers = headers or {}


def check_redirect_uri(uri: Any) -> str:
    """Return a redirect URI a client may register: https, or http on a loopback host."""
    if not isinstance(uri, str) or not uri or len(uri) > 2000:
        raise OAuthError("invalid_redirect_uri", "a redirect URI is a URL of 1-2000 characters")
    if any(ch.isspace() or not ch.isprintable() for ch in uri):
        raise OAuthError("invalid_redirect_uri", "a redirect URI holds no spaces or controls")
    parts = urllib.parse.urlsplit(uri)
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise OAuthError("invalid_redirect_uri", "the redirect URI has a bad port") from None
    host = parts.hostname or ""
    if "#" in uri or parts.username is not None or parts.password is not None or not host:
        raise OAuthError(
            "invalid_redirect_uri", "a redirect URI has a host and no #fragment or user info"
        )
    if parts.scheme == "https" or (
        parts.scheme == "http" and (host == "localhost" or is_loopback(host))
    ):
        return uri
    raise OAuthError(
        "invalid_redirect_uri", "a redirect URI must be https, or http on a loopback host"
    )


def redirect_matches(registered: Iterable[str], uri: str) -> bool:
    """Return whether uri is registered: exactly, or on loopback with any port (RFC 8252)."""
    if uri in registered:
        return True
    p = urllib.parse.urlsplit(uri)
    host = p.hostname or ""
    if p.scheme != "http" or not (host == "localhost" or is_loopback(host)):
        return False
    return any(
        (q.scheme, q.hostname, q.path, q.query) == ("http", host, p.path, p.query)
        for q in map(urllib.parse.urlsplit, registered)
    )


def parse_oauth_scope(text: Any) -> str:
    """Return the grant scope ("read" or "write") an OAuth scope string asks for; unknown
    scopes are ignored (RFC 6749 3.3 lets the server grant less)."""
    words = set(str(text or "").split())
    return "write" if "notes:write" in words else "read"


def pkce_matches(verifier: str, challenge: str) -> bool:
    """Return whether BASE64URL(SHA-256(verifier)) is the challenge (S256, RFC 7636)."""
    if not PKCE_RE.match(verifier or ""):
        return False
    digest = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=")
    return hmac.compare_digest(digest, challenge.encode())


def mcp_challenge(mcp_url: str, error: str = "") -> str:
    """Return the WWW-Authenticate value of a 401 on the MCP endpoint (RFC 9728 5.1): the
    metadata URL is the MCP URL's origin, the well-known name, then the MCP URL's path."""
    parts = urllib.parse.urlsplit(mcp_url)
    meta = f"{parts.scheme}://{parts.netloc}/.well-known/oauth-protected-resource{parts.path}"
    extra = f', error="{error}"' if error else ""
    return f'Bearer resource_metadata="{meta}", scope="{OAUTH_SCOPES[0]}"{extra}'


def public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Return whether an address is on the public internet (not loopback, private,
    link-local, multicast, reserved or unspecified), IPv4-mapped IPv6 unwrapped."""
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def fetch_client_metadata(
    url: str,
    resolve: Callable = socket.getaddrinfo,
    allow: Callable = public_address,
    context: Any = None,
    timeout: float = CIMD_TIMEOUT,
    limit: int = CIMD_MAX_BYTES,
) -> dict:
    """Return the JSON object a Client ID Metadata Document URL serves, fetched safely.

    https only; the host's every address must pass `allow` after DNS resolution, and the
    connection goes to the address checked (no second lookup a rebinding host could
    answer differently); redirects are not followed; `timeout` seconds in all and `limit`
    bytes at most. Raises ValueError saying why not.
    """
    import http.client  # outbound calls only: kept off the start-up path
    import ssl

    parts = urllib.parse.urlsplit(url)
    if (
        parts.scheme != "https"
        or not parts.hostname
        or parts.username is not None
        or parts.fragment
        or parts.path in ("", "/")
    ):
        raise ValueError("a client_id URL must be https, with a path and no user or #fragment")
    try:
        port = parts.port or 443
        infos = resolve(parts.hostname, port, type=socket.SOCK_STREAM)
        addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    except (OSError, UnicodeError, ValueError):
        raise ValueError(f"{parts.hostname} does not resolve") from None
    refused = [ip for ip in addrs if not allow(ip)]
    if not addrs or refused:
        shown = refused[0] if refused else "nothing"
        raise ValueError(f"{parts.hostname} resolves to {shown}, which is not a public address")
    deadline, opened = time.monotonic() + timeout, []

    class Pinned(http.client.HTTPSConnection):
        def connect(self) -> None:  # to the address checked; TLS still names the host
            sock = socket.create_connection((str(addrs[0]), self.port), timeout)
            self.sock = self._context.wrap_socket(
                sock, server_hostname=self.host, do_handshake_on_connect=False
            )
            opened.append(self.sock)  # the response keeps it after the connection lets go
            self.sock.do_handshake()

    conn = Pinned(
        parts.hostname, port, timeout=timeout, context=context or ssl.create_default_context()
    )
    expired = threading.Event()

    def cut() -> None:  # the socket's time-out bounds each read; this, the whole fetch
        expired.set()
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        target = urllib.parse.urlunsplit(("", "", parts.path, parts.query, ""))
        conn.request("GET", target, headers={"Accept": "application/json"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise ValueError(f"it answered a redirect (HTTP {resp.status}); none is followed")
        if resp.status != 200:
            raise ValueError(f"it answered HTTP {resp.status}")
        raw = b""
        while len(raw) <= limit:
            if time.monotonic() > deadline:
                raise ValueError(f"it took over {timeout:g} s")
            chunk = resp.read(min(16384, limit + 1 - len(raw)))
            if not chunk:
                break
            raw += chunk
        if len(raw) > limit:
            raise ValueError(f"it is over {limit} bytes")
    except (OSError, http.client.HTTPException, ssl.SSLError) as e:
        if expired.is_set():
            raise ValueError(f"it took over {timeout:g} s") from None
        reason = "timed out" if isinstance(e, (socket.timeout, TimeoutError)) else type(e).__name__
        raise ValueError(f"it could not be fetched ({reason})") from None
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set():  # cut short: what arrived is not the document
        raise ValueError(f"it took over {timeout:g} s")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("it is not JSON") from None
    if not isinstance(doc, dict):
        raise ValueError("it is not a JSON object")
    return doc
