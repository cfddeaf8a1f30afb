"""The secret of an elastic job: who may enter it.

``phalanx run --elastic`` makes a random secret (or takes ``PHALANX_SECRET`` when you
set it); its workers, spares and replacements inherit it, and ``phalanx join`` must
present it (``PHALANX_SECRET`` or ``--secret-file PATH``, never the command line, which
every user of the host can read). The secret itself never enters the store: the
launcher publishes a random nonce and an HMAC of it (so a joiner learns at once that
its secret is wrong), and a joiner proves itself with an HMAC of the nonce and its id,
which the members check (``hmac.compare_digest``) before anything else at admission.

Example:
    >>> s = make(); nonce = "n1"
    >>> matches(s, nonce, verifier(s, nonce)), matches("other", nonce, verifier(s, nonce))
    (True, False)
    >>> proves(s, nonce, "j1", proof(s, nonce, "j1")), proves(s, nonce, "j2", proof(s, nonce, "j1"))
    (True, False)
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Mapping

from ..errors import ConfigError, usage

ENV = "PHALANX_SECRET"


def make() -> str:
    """A fresh job secret: 256 random bits, as hex."""
    return secrets.token_hex(32)


def nonce() -> str:
    """A fresh per-job nonce (public: it goes into the store)."""
    return secrets.token_hex(16)


def _mac(secret: str, text: str) -> str:
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def verifier(secret: str, job_nonce: str) -> str:
    """What the launcher publishes so a joiner can tell a wrong secret at once (reveals nothing of it)."""
    return _mac(secret, f"phalanx-job/{job_nonce}")


def matches(secret: str, job_nonce: str, published: str) -> bool:
    """Does ``secret`` belong to the job that published ``published``?"""
    return hmac.compare_digest(verifier(secret, job_nonce), published)


def proof(secret: str, job_nonce: str, wid: str) -> str:
    """A joiner's proof that it holds the secret, bound to this job and to its own id."""
    return _mac(secret, f"phalanx-join/{job_nonce}/{wid}")


def proves(secret: str, job_nonce: str, wid: str, presented: str) -> bool:
    """Check a joiner's proof in constant time."""
    return hmac.compare_digest(proof(secret, job_nonce, wid), presented)


def load(env: Mapping[str, str] | None = None, path: str | None = None) -> str | None:
    """The secret a joiner presents: the file at ``path`` if given, else ``PHALANX_SECRET``; None if neither."""
    env = os.environ if env is None else env
    if path is not None:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError as err:
            raise ConfigError(usage(f"--secret-file {path} ({err.strerror})", "a readable file holding the job's "
                                    "secret", "Copy the file the launcher named to this host.")) from None
        if not text:
            raise ConfigError(usage(f"--secret-file {path} (empty)", "the job's secret",
                                    "Copy the file the launcher named to this host."))
        return text
    return env.get(ENV) or None
