"""Remove credentials from checkpoint ids before they reach any span or log.

Checkpoint ids are often URLs, and URLs carry secrets: user-info
(``s3://KEY:SECRET@bucket``), and signed query strings (``X-Amz-Signature=``,
``sig=`` of an Azure SAS, ``X-Goog-Credential=``). Rather than guessing which
query parameters are secret, every query value is replaced: a query string in a
checkpoint id is rare, and a leaked signature is not worth the guess.

Exception text is free text that may quote such URLs (a storage error naming
the signed URL it failed on): :func:`redact_text` redacts every URL in it the
same way, and the value of any parameter whose name says it is a secret.

Usage::

    >>> redact_checkpoint_id("s3://AKIA:s3cr3t@bucket/ckpt/step-10?X-Amz-Signature=abc")
    's3://REDACTED@bucket/ckpt/step-10?X-Amz-Signature=REDACTED'
    >>> redact_checkpoint_id("/checkpoints/step-10")
    '/checkpoints/step-10'
    >>> redact_text("PUT https://b.s3.amazonaws.com/k?X-Amz-Signature=abc failed: 403")
    'PUT https://b.s3.amazonaws.com/k?X-Amz-Signature=REDACTED failed: 403'
"""

from __future__ import annotations

import os
import re
from typing import Final

REDACTED: Final = "REDACTED"
#: Longest checkpoint id kept in an attribute; longer ones are cut with "...".
MAX_LENGTH: Final = 512

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
#: A URL inside free text: up to whitespace, a quote or a closing bracket.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()\[\]{}]+")
#: ``name=value`` outside a URL, where the name says the value is a secret.
_SECRET_PARAM = re.compile(
    r"(?i)\b((?:x-amz|x-goog|x-ms)-[a-z0-9-]*(?:signature|credential|token|key)[a-z0-9-]*|sig|signature|"
    r"access_token|refresh_token|token|password|passwd|secret|client_secret|api_key|apikey|sharedaccesssignature)"
    r"=([^&\s'\"<>;,]+)"
)


def redact_checkpoint_id(checkpoint_id: str | os.PathLike[str] | None) -> str:
    """Return ``checkpoint_id`` as a string with user-info and query values redacted.

    ``None`` becomes ``""``. The result is deterministic, so every rank derives
    the same value from the same id even when their signed URLs differ.
    """
    if checkpoint_id is None:
        return ""
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else str(checkpoint_id)
    if "#" in text:
        text = text.split("#", 1)[0]  # a fragment is never needed to name a checkpoint
    head, sep, query = text.partition("?")
    if sep:
        params = [p.partition("=") for p in query.split("&") if p]
        query = "&".join(k + ("=" + REDACTED if eq else "") for k, eq, _ in params)
    # (A path, the usual id, has no "://": no regular expression to run at every operation's start.)
    match = _SCHEME.match(head) if "://" in head else None
    if match:
        authority_start = match.end()
        slash = head.find("/", authority_start)
        authority_end = len(head) if slash == -1 else slash
        at = head.rfind("@", authority_start, authority_end)
        if at == -1:
            # user-info with an unescaped "/" (an AWS secret key has them): a later "@" after a "user:" part
            later = head.rfind("@", authority_end)
            if later != -1 and ":" in head[authority_start:authority_end]:
                at = later
        if at != -1:
            head = head[:authority_start] + REDACTED + head[at:]
    text = head + (sep + query if sep else "")
    if len(text) > MAX_LENGTH:
        text = text[: MAX_LENGTH - 3] + "..."
    return text


def redact_text(text: str) -> str:
    """``text`` with every URL redacted as a checkpoint id is, and every secret-named parameter's value.

    For exception messages and stack traces. Nothing is cut (the caller caps the
    length); text without a URL or a secret-named parameter is returned as is.
    """
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: _redact_url(m.group()), text)
    if "=" in text:
        text = _SECRET_PARAM.sub(lambda m: f"{m.group(1)}={REDACTED}", text)
    return text


def _redact_url(url: str) -> str:
    return redact_checkpoint_id(url) if len(url) <= MAX_LENGTH else redact_checkpoint_id(url[:MAX_LENGTH])
