"""Remove credentials from checkpoint ids before they reach any span or log.

Checkpoint ids are often URLs, and URLs carry secrets: user-info
(``s3://KEY:SECRET@bucket``), and signed query strings (``X-Amz-Signature=``,
``sig=`` of an Azure SAS, ``X-Goog-Credential=``). Rather than guessing which
query parameters are secret, every query value is replaced: a query string in a
checkpoint id is rare, and a leaked signature is not worth the guess.

Usage::

    >>> redact_checkpoint_id("s3://AKIA:s3cr3t@bucket/ckpt/step-10?X-Amz-Signature=abc")
    's3://REDACTED@bucket/ckpt/step-10?X-Amz-Signature=REDACTED'
    >>> redact_checkpoint_id("/checkpoints/step-10")
    '/checkpoints/step-10'
"""

from __future__ import annotations

import os
import re
from typing import Final

REDACTED: Final = "REDACTED"
#: Longest checkpoint id kept in an attribute; longer ones are cut with "...".
MAX_LENGTH: Final = 512

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def redact_checkpoint_id(checkpoint_id: str | os.PathLike[str] | None) -> str:
    """Return ``checkpoint_id`` as a string with user-info and query values redacted.

    ``None`` becomes ``""``. The result is deterministic, so every rank derives
    the same value from the same id even when their signed URLs differ.
    """
    if checkpoint_id is None:
        return ""
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else str(checkpoint_id)
    text = text.split("#", 1)[0]  # a fragment is never needed to name a checkpoint
    head, sep, query = text.partition("?")
    if sep:
        params = [p.partition("=") for p in query.split("&") if p]
        query = "&".join(k + ("=" + REDACTED if eq else "") for k, eq, _ in params)
    match = _SCHEME.match(head)
    if match:
        authority_start = match.end()
        slash = head.find("/", authority_start)
        authority_end = len(head) if slash == -1 else slash
        at = head.rfind("@", authority_start, authority_end)
        if at != -1:
            head = head[:authority_start] + REDACTED + head[at:]
    text = head + (sep + query if sep else "")
    if len(text) > MAX_LENGTH:
        text = text[: MAX_LENGTH - 3] + "..."
    return text
