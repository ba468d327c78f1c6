"""An optional API key, as vLLM's server takes one (`--api-key`, or VLLM_API_KEY): a request without
`Authorization: Bearer <key>` is answered 401 `{"error": "Unauthorized"}`, vLLM's answer, before any
routing. vLLM guards its /v1 routes only; here every route but /health is guarded, /generate and
/tokenize included, so that setting a key leaves nothing open.

The replicas never receive the key: they compare the SHA-256 of what a request carries with the
key's, in constant time, so the key is in no deployment argument Ray keeps.
"""

from __future__ import annotations

import hashlib
import hmac
import os

API_KEY_ENV = "BAIGE_RAY_API_KEY"
UNAUTHORIZED = {"error": "Unauthorized"}


def api_key_digest(api_key: str | None) -> str | None:
    """The SHA-256 (hex) of `api_key`, or of the BAIGE_RAY_API_KEY environment variable when it is None;
    None when neither is set (no key asked)."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"serve(api_key=...) is invalid: expected a non-empty string (or {API_KEY_ENV} unset)")
    return _digest(key)


def is_authorized(authorization: str | None, digest: str) -> bool:
    """Whether an Authorization header carries the key whose digest is `digest` as a bearer token."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(_digest(token.strip()), digest)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
