"""Tenants, bearer tokens, the page's cookie sign-in, CSRF protection and CORS for the server.

* **Tokens.** :class:`Tenants` maps bearer tokens to tenants. Read them with :meth:`Tenants.from_file`
  (lines ``tenant:token``; ``#`` starts a comment) or :meth:`Tenants.from_env` (``FSM_AGENT_TOKENS``
  = ``tenant:token,tenant:token``, or ``FSM_AGENT_TOKENS_FILE`` = a path). Without tokens the
  server has one tenant, ``default``, and no sign-in: :func:`check_bind` then refuses every
  address but loopback.
* **Every session belongs to one tenant** (its ``metadata["tenant"]``; a sub-agent's session
  copies its parent's; a session made outside the server has none and belongs to ``default``,
  :func:`tenant_of`). A session of another tenant answers 404 on every route. With tokens no tenant
  may be named ``default``, so sessions without a tenant are nobody's to read.
* **The page** signs in once (``POST /auth/login`` with the token) and then uses the HttpOnly
  cookie ``fsm_auth``: ``EventSource`` cannot send headers. The cookie is
  ``tenant.expiry.hmac`` signed with a key derived from the configured tokens, so every replica
  that reads the same tokens accepts it, and changing the tokens signs everyone out.
* **Cross-site requests.** A state-changing request (POST) without ``Authorization: Bearer``
  (browsers never add it by themselves) is refused when the browser labels it cross-site
  (``Sec-Fetch-Site``, ``Origin`` not this server nor a CORS origin), and, when it is signed in by
  cookie, unless it carries the header ``X-CSRF-Token`` equal to the ``fsm_csrf`` cookie (double
  submit; a custom header also forces a CORS preflight). The same rules hold without tokens: a
  page on another site cannot drive a loopback server.
* **Default permissions.** A tenant may have default session permissions
  (:class:`~fsm_agent.Permissions`; ``Tenants(tokens, permissions={tenant: ...})``, or
  ``fsm-agent serve --tenant-permissions FILE``): every session the tenant creates gets them, narrowed
  by the request's own (``POST /sessions`` ``permissions``) and a task's; a request can never widen them.
* **CORS** is off unless ``cors_origins`` lists origins; then those origins get
  ``Access-Control-Allow-Origin`` (no credentials: cross-origin callers use bearer tokens).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

from aiohttp import web

from ..errors import ConfigurationError, PermissionsError
from ..permissions import Permissions
from ..store.base import SessionRecord

__all__ = ["AUTH_COOKIE", "CSRF_COOKIE", "CSRF_HEADER", "DEFAULT_TENANT", "Tenants", "check_bind", "check_same_origin",
           "is_loopback", "tenant_of"]

DEFAULT_TENANT = "default"
"""The tenant of a session without one (made outside the server), and the one tenant of a server
without tokens. Reserved: no token may name it."""
AUTH_COOKIE = "fsm_auth"
CSRF_COOKIE = "fsm_csrf"
CSRF_HEADER = "X-CSRF-Token"
COOKIE_TTL = 12 * 3600.0
"""Seconds a sign-in cookie lasts."""


def tenant_of(record: SessionRecord) -> str:
    """The tenant a session belongs to: its ``metadata["tenant"]``, else :data:`DEFAULT_TENANT`."""
    t = record.metadata.get("tenant") if isinstance(record.metadata, dict) else None
    return t if isinstance(t, str) and t else DEFAULT_TENANT


class Tenants:
    """Bearer tokens by tenant.

    Args:
        tokens: token -> tenant. Empty: no authentication (one tenant, ``default``; loopback only).
        permissions: tenant -> the default permissions of the sessions it creates (see the module doc).

    Raises:
        ConfigurationError: an empty token or tenant, a token shorter than 16 characters, or a tenant
            named ``default`` (:data:`DEFAULT_TENANT`, reserved); permissions for a tenant no token names.
    """

    def __init__(self, tokens: Mapping[str, str] | None = None, *,
                 permissions: Mapping[str, Permissions] | None = None) -> None:
        self.tokens = dict(tokens or {})
        for tok, tenant in self.tokens.items():
            if len(tok) < 16:
                raise ConfigurationError(f"the token of tenant {tenant!r} is shorter than 16 characters; "
                                         "use e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`")
            if not tenant or any(c in tenant for c in ":,.\r\n\0"):
                raise ConfigurationError(f"bad tenant name {tenant!r}: non-empty, without ':' ',' '.' or line breaks")
            if tenant == DEFAULT_TENANT:
                raise ConfigurationError(f"the tenant name {DEFAULT_TENANT!r} is reserved: sessions made outside the "
                                         "server (and a server without tokens) belong to it; give this token's "
                                         "tenant another name")
        self.permissions: dict[str, Permissions] = {}
        """Each tenant's default session permissions."""
        self.set_permissions(permissions or {})
        material = "\n".join(sorted(f"{t}:{k}" for k, t in self.tokens.items())).encode()
        self._key = hashlib.sha256(b"fsm-agent cookie key\n" + material).digest() if self.tokens \
            else secrets.token_bytes(32)

    def set_permissions(self, permissions: Mapping[str, Permissions]) -> None:
        """Set each tenant's default session permissions.

        Raises:
            ConfigurationError: a tenant no token names (without tokens, the one tenant is ``default``).
        """
        known = set(self.tokens.values()) if self.tokens else {DEFAULT_TENANT}
        unknown = sorted(set(permissions) - known)
        if unknown:
            raise ConfigurationError(f"default permissions for tenant(s) no token names: {', '.join(unknown)} "
                                     f"(tenants: {', '.join(sorted(known))})")
        self.permissions = dict(permissions)

    def permissions_for(self, tenant: str) -> Permissions | None:
        """``tenant``'s default session permissions, or ``None`` (no default)."""
        return self.permissions.get(tenant)

    @staticmethod
    def read_permissions(path: str | Path) -> dict[str, Permissions]:
        """Tenants' default permissions from a TOML file (JSON when the name ends in ``.json``): one table
        per tenant name, in the permissions format (``[acme]`` ``tools = [...]``, ``[[acme.scope]]`` ...).

        Raises:
            PermissionsError: the file cannot be read or parsed, or a tenant's permissions are invalid.
        """
        import json
        import tomllib

        source = str(path)
        try:
            text = Path(path).read_bytes()
            data = json.loads(text) if source.endswith(".json") else tomllib.loads(text.decode("utf-8"))
        except OSError as exc:
            raise PermissionsError([f"{source}: cannot read the file: {exc.strerror or exc}"]) from exc
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PermissionsError([f"{source}: invalid {'JSON' if source.endswith('.json') else 'TOML'}: {exc}"]
                                   ) from exc
        if not isinstance(data, dict):
            raise PermissionsError([f"{source}: expected one table per tenant"])
        out: dict[str, Permissions] = {}
        problems: list[str] = []
        for tenant, table in data.items():
            try:
                out[tenant] = Permissions.from_dict(table, source=f"{source}: tenant {tenant!r}")
            except PermissionsError as exc:
                problems.extend(exc.problems)
        if problems:
            raise PermissionsError(problems)
        return out

    @property
    def enabled(self) -> bool:
        """Whether tokens are configured (else: no authentication, loopback only)."""
        return bool(self.tokens)

    @classmethod
    def parse(cls, pairs: Iterable[str], source: str) -> Tenants:
        """From ``tenant:token`` strings.

        Raises:
            ConfigurationError: a pair without ``:``; a token given twice.
        """
        tokens: dict[str, str] = {}
        for n, raw in enumerate(pairs, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            tenant, sep, token = line.partition(":")
            if not sep:
                raise ConfigurationError(f"{source}, entry {n}: expected TENANT:TOKEN")
            tenant, token = tenant.strip(), token.strip()
            if token in tokens:
                raise ConfigurationError(f"{source}, entry {n}: this token is already given to tenant {tokens[token]!r}")
            tokens[token] = tenant
        return cls(tokens)

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        """From a file of ``tenant:token`` lines.

        Raises:
            ConfigurationError: the file cannot be read, or a line is malformed.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigurationError(f"cannot read the tokens file {path}: {e.strerror or e}") from e
        return cls.parse(text.splitlines(), str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Tenants:
        """From ``FSM_AGENT_TOKENS`` (``tenant:token,...``) or ``FSM_AGENT_TOKENS_FILE``; none set: no tokens."""
        env = os.environ if environ is None else environ
        if env.get("FSM_AGENT_TOKENS_FILE"):
            return cls.from_file(env["FSM_AGENT_TOKENS_FILE"])
        if env.get("FSM_AGENT_TOKENS"):
            return cls.parse(env["FSM_AGENT_TOKENS"].split(","), "FSM_AGENT_TOKENS")
        return cls()

    def tenant_for(self, token: str) -> str | None:
        """The tenant of ``token`` (constant-time comparison), or ``None``."""
        found = None
        for tok, tenant in self.tokens.items():
            if hmac.compare_digest(tok.encode(), token.encode()):
                found = tenant
        return found

    def _sign(self, text: str) -> str:
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def cookie_for(self, tenant: str, now: float | None = None) -> str:
        """The ``fsm_auth`` cookie value for ``tenant``."""
        expiry = int((now or time.time()) + COOKIE_TTL)
        body = f"{base64.urlsafe_b64encode(tenant.encode()).decode()}.{expiry}"
        return f"{body}.{self._sign(body)}"

    def tenant_of_cookie(self, value: str, now: float | None = None) -> str | None:
        """The tenant of a valid, unexpired ``fsm_auth`` cookie, or ``None``."""
        body, _, mac = value.rpartition(".")
        if not body or not hmac.compare_digest(self._sign(body), mac):
            return None
        b64, _, expiry = body.partition(".")
        try:
            if int(expiry) < (now or time.time()):
                return None
            return base64.urlsafe_b64decode(b64.encode()).decode()
        except (ValueError, UnicodeDecodeError):
            return None

    def csrf_for(self, auth_cookie: str) -> str:
        """The CSRF token bound to a sign-in cookie (or to ``""`` without tokens)."""
        return self._sign("csrf\n" + auth_cookie)[:32]

    def __repr__(self) -> str:
        return f"Tenants({len(self.tokens)} token(s))"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tenants: Tenants) -> None:
    """Refuse to listen on a non-loopback address without tokens.

    Raises:
        ConfigurationError: ``host`` is not loopback and no tokens are configured.
    """
    if not tenants.enabled and not is_loopback(host):
        raise ConfigurationError(
            f"refusing to listen on {host} without tokens: anyone who can reach it could drive your agents. "
            "Configure tokens (FSM_AGENT_TOKENS=tenant:token, FSM_AGENT_TOKENS_FILE or --tokens FILE), "
            "or listen on 127.0.0.1")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Unauthorized(Exception):
    """No valid token or cookie (401)."""


class Forbidden(Exception):
    """A cross-site or CSRF-less state-changing request (403)."""


PUBLIC = frozenset({"/healthz", "/openapi.json", "/auth/login", "/auth/logout", "/.well-known/agent-card.json"})
"""Paths that need no authentication (the page's own files are public too: ``/review/…``, ``/static/…``;
the A2A agent card is discovery, served when :func:`fsm_agent.server.a2a.add_a2a_routes` mounts A2A)."""


def authenticate(request: web.Request, tenants: Tenants, cors_origins: frozenset[str]) -> str:
    """The tenant of ``request``, after the CSRF and origin checks of a state-changing request.

    Raises:
        Unauthorized: tokens are configured and the request has neither a valid bearer token nor
            a valid sign-in cookie.
        Forbidden: a POST without a bearer token whose ``X-CSRF-Token`` does not match its
            ``fsm_csrf`` cookie, or whose ``Origin`` is foreign.
    """
    bearer = None
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        bearer = header[7:].strip()
    cookie = request.cookies.get(AUTH_COOKIE, "")
    tenant: str | None
    if bearer is not None:
        tenant = tenants.tenant_for(bearer) if tenants.enabled else DEFAULT_TENANT
        if tenant is None:
            raise Unauthorized("the bearer token is not valid")
    elif tenants.enabled:
        tenant = tenants.tenant_of_cookie(cookie) if cookie else None
        if tenant is None:
            raise Unauthorized("sign in: send `Authorization: Bearer <token>`, or POST /auth/login with the token"
                               + (" (the sign-in cookie has expired or is not valid)" if cookie else ""))
    else:
        tenant = DEFAULT_TENANT
    if request.method not in ("GET", "HEAD", "OPTIONS") and bearer is None:
        check_same_origin(request, cors_origins)
        if cookie:
            sent = request.headers.get(CSRF_HEADER, "")
            expected = request.cookies.get(CSRF_COOKIE, "")
            if not expected or not hmac.compare_digest(sent, expected) or expected != tenants.csrf_for(cookie):
                raise Forbidden(f"missing or wrong {CSRF_HEADER} header: send the value of the {CSRF_COOKIE} "
                                "cookie, or use a bearer token")
    return tenant


def check_same_origin(request: web.Request, cors_origins: frozenset[str]) -> None:
    """Refuse a cross-site state-changing request, as browsers label it: ``Sec-Fetch-Site`` other
    than ``same-origin`` or ``none``, or an ``Origin`` that is neither this server nor a CORS origin.
    A request with neither header does not come from a browser page (curl, SDKs) and passes.

    Raises:
        Forbidden: a cross-site request.
    """
    origin = request.headers.get("Origin")
    allowed = origin is not None and (origin == _own_origin(request) or origin in cors_origins)
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none") and not allowed:
        raise Forbidden(f"cross-site request refused (Sec-Fetch-Site: {site}, Origin: {origin or 'none'})")
    if origin is not None and origin != "null" and not allowed:
        raise Forbidden(f"cross-site request from {origin} refused")
    if origin == "null" and site != "same-origin":
        raise Forbidden("a request from an opaque origin (Origin: null) is refused")


def _own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def set_cookies(response: web.StreamResponse, tenants: Tenants, auth_cookie: str | None, *, secure: bool) -> None:
    """Set the sign-in cookie (when given) and the CSRF cookie bound to it."""
    if auth_cookie is not None:
        response.set_cookie(AUTH_COOKIE, auth_cookie, httponly=True, samesite="Strict", secure=secure, path="/",
                            max_age=int(COOKIE_TTL))
    response.set_cookie(CSRF_COOKIE, tenants.csrf_for(auth_cookie or ""), httponly=False, samesite="Strict",
                        secure=secure, path="/", max_age=int(COOKIE_TTL))
