"""The server's certificate for <id>.D: ACME (RFC 8555) by DNS-01 through its relay, kept.

In passthrough mode TLS ends on the home server, so it needs a certificate of its own
for its name on the relay, `<serverId>.<domain>`. It gets one from an ACME CA
(SERVICE_ACME_DIRECTORY; Let's Encrypt by default) by the DNS-01 challenge: the relay
answers DNS for its domain and publishes `TXT _acme-challenge.<id>.D` only as server <id>
sets it over its own authenticated link. The key is made here and never leaves
`.notesvc/tls/` (0600): neither the relay nor the CA ever holds it.

ECDSA P-256 keys, for the account and the certificate, and the JWS signatures need the
`cryptography` package (Debian's python3-cryptography), imported only here and only when
passthrough is wanted: without it the mode says so at start and stays off.

`CertKeeper` renews at two thirds of a certificate's lifetime; a failure backs off
(doubling from a minute to six hours) and shows in /system/info and the audit, and the
certificate in hand keeps serving until it expires.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import random
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from notesvc.boot import __version__, log
from notesvc.helpers import atomic_write, iso, log_safe
from notesvc.passthrough.wire import certificate_facts

LETS_ENCRYPT = "https://acme-v02.api.letsencrypt.org/directory"
TLS_FOLDER = "tls"
SERVER_PEM = "server.pem"  # the certificate's key, then its chain: one file, one rename
ACCOUNT_PEM = "account.pem"


def has_cryptography() -> bool:
    """Return whether the `cryptography` package (ECDSA keys, JWS, CSRs) can be imported."""
    try:
        import cryptography.hazmat.primitives.asymmetric.ec  # noqa: F401
    except ImportError:
        return False
    return True


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


# -- keys, signatures, requests ------------------------------------------------------------


def new_private_key_pem() -> bytes:
    """Return a new ECDSA P-256 private key (PKCS#8 PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(pem: bytes) -> Any:
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(pem, password=None)


def jwk_of(key: Any) -> dict:
    """Return the public JWK of a P-256 key (RFC 7518 6.2), members in thumbprint order."""
    numbers = key.public_key().public_numbers()
    return {
        "crv": "P-256",
        "kty": "EC",
        "x": b64url(numbers.x.to_bytes(32, "big")),
        "y": b64url(numbers.y.to_bytes(32, "big")),
    }


def jwk_thumbprint(jwk: dict) -> str:
    """Return the JWK's SHA-256 thumbprint (RFC 7638), base64url."""
    canonical = json.dumps(jwk, sort_keys=True, separators=(",", ":")).encode()
    return b64url(hashlib.sha256(canonical).digest())


def dns01_value(token: str, thumbprint: str) -> str:
    """Return the TXT value a DNS-01 challenge asks for (RFC 8555 8.4)."""
    return b64url(hashlib.sha256(f"{token}.{thumbprint}".encode()).digest())


def es256(key: Any, data: bytes) -> bytes:
    """Return the JWS ES256 signature of data: r and s, 32 bytes each (RFC 7518 3.4)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def csr_der(key: Any, name: str) -> bytes:
    """Return a certificate signing request for one DNS name (DER)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    subject = [x509.NameAttribute(NameOID.COMMON_NAME, name)] if len(name) <= 64 else []
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name(subject))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.DER)


class AcmeError(Exception):
    """An ACME CA's refusal or failure, in words fit for /system/info (never a secret)."""

    def __init__(self, message: str, kind: str = "", status: int = 0):
        super().__init__(message)
        self.kind, self.status = kind, status


class AcmeClient:
    """RFC 8555 over HTTPS, for one account key: directory, nonces (badNonce retried),
    JWS-signed POSTs, the order of one DNS name by DNS-01."""

    TIMEOUT = 30.0  # seconds for one request to the CA
    POLL_SECONDS = 120.0  # how long an authorisation or an order may stay pending
    NONCE_RETRIES = 5

    def __init__(self, directory: str, ca_file: str, account_key: Any, email: str = ""):
        self.directory_url, self.key, self.email = directory, account_key, email
        self.context = ssl.create_default_context(cafile=ca_file or None)
        self.jwk = jwk_of(account_key)
        self.thumbprint = jwk_thumbprint(self.jwk)
        self.urls: dict = {}
        self.kid = ""
        self.nonce = ""
        self.stop = threading.Event()

    def _http(self, method: str, url: str, body: bytes | None = None) -> tuple:
        """Return (status, headers, body bytes) of one request to the CA."""
        headers = {"User-Agent": f"notesvc/{__version__}"}
        if body is not None:
            headers["Content-Type"] = "application/jose+json"
        req = urllib.request.Request(url, body, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.TIMEOUT, context=self.context) as r:
                return r.status, r.headers, r.read(1 << 20)
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.headers, e.read(1 << 20)
        except (OSError, ValueError) as e:  # refused, timed out, TLS, a bad URL
            reason = getattr(e, "reason", None) or e
            raise AcmeError(f"the ACME CA at {url} cannot be reached: {reason}") from None

    def directory(self) -> dict:
        if not self.urls:
            status, _headers, raw = self._http("GET", self.directory_url)
            try:
                urls = json.loads(raw)
            except ValueError:
                urls = None
            if status != 200 or not isinstance(urls, dict) or "newOrder" not in urls:
                raise AcmeError(f"{self.directory_url} is not an ACME directory (HTTP {status})")
            self.urls = urls
        return self.urls

    def _new_nonce(self) -> str:
        status, headers, _ = self._http("HEAD", self.directory()["newNonce"])
        nonce = headers.get("Replay-Nonce", "")
        if not nonce:
            raise AcmeError(f"the ACME CA gave no nonce (HTTP {status})")
        return nonce

    def post(self, url: str, payload: Any, use_jwk: bool = False) -> tuple:
        """Return (status, headers, parsed body) of a JWS-signed POST (`payload` None:
        POST-as-GET); a badNonce is retried with the nonce it brought.

        Raises AcmeError for a problem document the CA answers."""
        for _ in range(self.NONCE_RETRIES):
            nonce = self.nonce or self._new_nonce()
            self.nonce = ""
            protected = {"alg": "ES256", "nonce": nonce, "url": url}
            if use_jwk:
                protected["jwk"] = self.jwk
            else:
                protected["kid"] = self.kid
            head = b64url(json.dumps(protected).encode())
            body = "" if payload is None else b64url(json.dumps(payload).encode())
            signature = b64url(es256(self.key, f"{head}.{body}".encode()))
            jws = json.dumps({"protected": head, "payload": body, "signature": signature})
            status, headers, raw = self._http("POST", url, jws.encode())
            self.nonce = headers.get("Replay-Nonce", "")
            ctype = headers.get("Content-Type", "")
            parsed: Any = raw
            if "json" in ctype:
                try:
                    parsed = json.loads(raw)
                except ValueError:
                    parsed = {}
            if status < 400:
                return status, headers, parsed
            problem = parsed if isinstance(parsed, dict) else {}
            kind = str(problem.get("type", ""))
            if kind.endswith(":badNonce"):
                continue
            detail = log_safe(str(problem.get("detail", "")), 300) or f"HTTP {status}"
            name = kind.rsplit(":", 1)[-1] or "error"
            raise AcmeError(f"the ACME CA refused ({name}): {detail}", kind, status)
        raise AcmeError("the ACME CA kept refusing our nonces (badNonce)", "badNonce")

    def account(self) -> str:
        """Register the account (or find it: the same key is the same account)."""
        if not self.kid:
            payload: dict = {"termsOfServiceAgreed": True}
            if self.email:
                payload["contact"] = [f"mailto:{self.email}"]
            status, headers, _ = self.post(self.directory()["newAccount"], payload, use_jwk=True)
            self.kid = headers.get("Location", "")
            if status not in (200, 201) or not self.kid:
                raise AcmeError(f"the ACME CA did not make an account (HTTP {status})")
        return self.kid

    def _wait(self, url: str, pending: tuple, what: str) -> dict:
        """POST-as-GET `url` until its status leaves `pending`; return the object."""
        deadline = time.monotonic() + self.POLL_SECONDS
        while True:
            _s, headers, obj = self.post(url, None)
            if not isinstance(obj, dict):
                raise AcmeError(f"the ACME CA's {what} is not JSON")
            if obj.get("status") not in pending:
                return obj
            if time.monotonic() > deadline:
                raise AcmeError(f"the {what} stayed {obj.get('status')} for too long")
            delay = 1.0
            with contextlib.suppress(ValueError):
                delay = min(10.0, max(0.2, float(headers.get("Retry-After", "1"))))
            if self.stop.wait(delay):
                raise AcmeError("stopped")

    def obtain(self, name: str, publish: Callable, withdraw: Callable) -> tuple:
        """Return (key PEM, chain PEM) of a new certificate for `name`, proving control
        of it by DNS-01: publish([values]) before answering the challenges, withdraw()
        after (whatever the outcome)."""
        self.account()
        status, headers, order = self.post(
            self.directory()["newOrder"], {"identifiers": [{"type": "dns", "value": name}]}
        )
        order_url = headers.get("Location", "")
        if status != 201 or not isinstance(order, dict) or not order_url:
            raise AcmeError(f"the ACME CA did not make an order (HTTP {status})")
        try:
            self._authorise(order, publish)
        finally:
            try:
                withdraw()
            except Exception as e:  # the relay drops it after 10 minutes anyway
                log.warning("acme: withdrawing the challenge record failed: %s", e)
        order = self._wait(order_url, ("pending",), "order")
        if order.get("status") != "ready":
            raise AcmeError(f"the order is {order.get('status')}: {_problem_of(order)}")
        key_pem = new_private_key_pem()
        csr = csr_der(_load_key(key_pem), name)
        self.post(order["finalize"], {"csr": b64url(csr)})
        order = self._wait(order_url, ("processing", "ready"), "order")
        if order.get("status") != "valid" or not order.get("certificate"):
            raise AcmeError(f"the order is {order.get('status')}: {_problem_of(order)}")
        _s, _h, chain = self.post(order["certificate"], None)
        if not isinstance(chain, bytes) or b"BEGIN CERTIFICATE" not in chain:
            raise AcmeError("the ACME CA's certificate is not PEM")
        return key_pem, chain

    def _authorise(self, order: dict, publish: Callable) -> None:
        """Answer every pending authorisation of an order by DNS-01 and wait for each."""
        pending = []
        for url in order.get("authorizations", []):
            _s, _h, authz = self.post(url, None)
            if not isinstance(authz, dict):
                raise AcmeError("the ACME CA's authorisation is not JSON")
            if authz.get("status") == "valid":
                continue  # reused (RFC 8555 7.1.3)
            challenge = next(
                (c for c in authz.get("challenges", []) if c.get("type") == "dns-01"), None
            )
            if challenge is None:
                raise AcmeError("the ACME CA offers no dns-01 challenge")
            pending.append((url, challenge))
        if not pending:
            return
        publish([dns01_value(c["token"], self.thumbprint) for _u, c in pending])
        for _url, challenge in pending:
            self.post(challenge["url"], {})
        for url, _challenge in pending:
            authz = self._wait(url, ("pending", "processing"), "authorisation")
            if authz.get("status") != "valid":
                failed = next(
                    (c for c in authz.get("challenges", []) if c.get("error")), {"error": {}}
                )
                raise AcmeError(f"DNS-01 failed: {_problem_of(failed)}")


def _problem_of(obj: dict) -> str:
    error = obj.get("error") if isinstance(obj.get("error"), dict) else {}
    return log_safe(str(error.get("detail") or error.get("type") or "no reason given"), 300)


# -- the certificate on disk ------------------------------------------------------------


class TlsFolder:
    """`.notesvc/tls/`: server.pem (the key, then the chain) and account.pem, 0600."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / TLS_FOLDER

    def _ensure(self) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)

    def account_key(self) -> Any:
        """Return the ACME account's key, made (and kept) on first use."""
        self._ensure()
        path = self.path / ACCOUNT_PEM
        if not path.exists():
            atomic_write(path, new_private_key_pem(), mode=0o600)
        return _load_key(path.read_bytes())

    def save(self, key_pem: bytes, chain_pem: bytes) -> None:
        self._ensure()
        atomic_write(self.path / SERVER_PEM, key_pem + b"\n" + chain_pem, mode=0o600)

    def facts(self) -> dict:
        """Return the facts of the certificate kept (certificate_facts), {} without one."""
        try:
            return certificate_facts((self.path / SERVER_PEM).read_text("ascii", "replace"))
        except OSError:
            return {}

    def context(self) -> ssl.SSLContext:
        """Return a server SSLContext on the certificate kept (TLS 1.2+, HTTP/1.1).

        Raises OSError or ssl.SSLError when it is missing or its key does not match."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.path / SERVER_PEM))
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


def renew_at(facts: dict) -> float:
    """Return when a certificate is renewed: two thirds into its lifetime."""
    return facts["notBefore"] + (facts["notAfter"] - facts["notBefore"]) * 2 / 3


class CertKeeper:
    """Gets and renews the certificate for one name on a thread of its own.

    `publish(values)` and `withdraw()` set and clear the challenge records through the
    relay; `changed()` is called when a new certificate is in place (and when the one in
    hand has expired). `context()` is the SSLContext to serve with, or None.
    """

    BACKOFF_FIRST = 60.0
    BACKOFF_MOST = 6 * 3600.0

    def __init__(
        self,
        folder: TlsFolder,
        directory: str,
        ca_file: str,
        email: str,
        publish: Callable,
        withdraw: Callable,
        changed: Callable,
    ):
        self.folder, self.directory, self.ca_file, self.email = folder, directory, ca_file, email
        self.publish, self.withdraw, self.changed = publish, withdraw, changed
        self.name = ""  # <serverId>.<domain>, once the relay has said it offers passthrough
        self.state = "waiting"  # waiting, obtaining, valid, renewing, error
        self.last_error: str | None = None
        self.failures = 0
        self.next_attempt = 0.0  # wall time of the next try after a failure
        self.last_success = 0.0
        self._context: ssl.SSLContext | None = None
        self._context_facts: dict = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="notesvc-acme", daemon=True)
        self._client: AcmeClient | None = None

    def start(self, name: str) -> None:
        """Keep a certificate for `name` (again, when it changed)."""
        with self._lock:
            if name != self.name:
                self.name, self.failures, self.next_attempt = name, 0, 0.0
        self._wake.set()
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._client is not None:
            self._client.stop.set()

    def usable(self, facts: dict, now: float | None = None) -> bool:
        """Return whether a certificate's facts fit this name and it is within its time."""
        now = time.time() if now is None else now
        return (
            bool(facts)
            and self.name in facts.get("names", [])
            and facts["notBefore"] <= now + 300
            and now < facts["notAfter"]
        )

    def context(self) -> ssl.SSLContext | None:
        """Return the SSLContext on the certificate kept while it is usable, else None."""
        with self._lock:
            if self._context is not None and not self.usable(self._context_facts):
                self._context = None
            return self._context

    def load(self) -> bool:
        """Take the certificate on disk when it is usable for the name; return whether."""
        facts = self.folder.facts()
        if not self.usable(facts):
            return False
        try:
            ctx = self.folder.context()
        except (OSError, ssl.SSLError) as e:
            where = self.folder.path
            log.warning("passthrough: the certificate in %s cannot be used: %s", where, e)
            return False
        with self._lock:
            self._context, self._context_facts = ctx, facts
        return True

    def status(self) -> dict:
        facts = self._context_facts if self._context is not None else {}
        return {
            "name": self.name or None,
            "state": self.state,
            "certificate": {
                "notBefore": iso(facts["notBefore"]),
                "notAfter": iso(facts["notAfter"]),
                "renewAt": iso(renew_at(facts)),
                "issuer": facts.get("issuer", ""),
            }
            if facts
            else None,
            "lastError": self.last_error,
            "nextAttemptAt": iso(self.next_attempt) if self.next_attempt else None,
            "acmeDirectory": self.directory,
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            wait = self._step()
            self._wake.wait(wait)

    def _step(self) -> float:
        """Do what is due now; return how long to wait before looking again."""
        if not self.name:
            return 3600.0
        had = self._context is not None
        self.load()  # the file on disk, when usable (a restart, a copy put there by hand)
        ctx = self.context()  # None once the one in hand has expired
        if had != (ctx is not None):
            self.changed()
        if ctx is not None and time.time() < renew_at(self._context_facts):
            self.state = "valid"
            return min(3600.0, max(1.0, renew_at(self._context_facts) - time.time()))
        now = time.time()
        if self.next_attempt and now < self.next_attempt:
            return self.next_attempt - now
        self.state = "renewing" if self._context is not None else "obtaining"
        try:
            self._obtain()
        except AcmeError as e:
            if self._stop.is_set():
                return 0.0
            self.failures += 1
            delay = min(self.BACKOFF_MOST, self.BACKOFF_FIRST * 2 ** (self.failures - 1))
            delay *= random.uniform(0.9, 1.1)  # noqa: S311 - spreading retries, no secret
            self.next_attempt = time.time() + delay
            self.state, self.last_error = "error", str(e)
            log.warning(
                "passthrough: no certificate for %s: %s; trying again in %.0f s%s",
                self.name,
                e,
                delay,
                " (the one in hand keeps serving)" if self._context is not None else "",
            )
            return delay
        except Exception as e:  # a bug: said once, tried again later
            self.failures += 1
            self.next_attempt = time.time() + self.BACKOFF_MOST
            self.state, self.last_error = "error", type(e).__name__
            log.exception("passthrough: getting a certificate failed")
            return self.BACKOFF_MOST
        self.failures, self.next_attempt, self.last_error = 0, 0.0, None
        self.last_success = time.time()
        self.load()
        self.state = "valid"
        log.info(
            "passthrough: a certificate for %s until %s",
            self.name,
            iso(self._context_facts.get("notAfter", 0)),
        )
        self.changed()
        return 1.0

    def _obtain(self) -> None:
        if self._client is None or self._client.directory_url != self.directory:
            self._client = AcmeClient(
                self.directory, self.ca_file, self.folder.account_key(), self.email
            )
            if self._stop.is_set():
                self._client.stop.set()
        key_pem, chain = self._client.obtain(self.name, self.publish, self.withdraw)
        facts = certificate_facts(chain.decode("ascii", "replace"))
        if not self.usable(facts):
            raise AcmeError("the ACME CA's certificate does not name this server")
        self.folder.save(key_pem, chain)
