"""Credentials in checkpoint ids never reach telemetry."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from dcp_otel.redact import MAX_LENGTH, redact_checkpoint_id


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/checkpoints/step-10", "/checkpoints/step-10"),
        (PurePosixPath("/ckpt/a"), "/ckpt/a"),
        (None, ""),
        ("s3://AKIAXXX:secret@bucket/ckpt", "s3://REDACTED@bucket/ckpt"),
        ("https://bucket.s3.amazonaws.com/ckpt?X-Amz-Credential=AKIA%2F&X-Amz-Signature=deadbeef",
         "https://bucket.s3.amazonaws.com/ckpt?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED"),
        ("https://acct.blob.core.windows.net/c/ckpt?sv=2022&sig=abc%3D&se=2026", "https://acct.blob.core.windows.net/c/ckpt?sv=REDACTED&sig=REDACTED&se=REDACTED"),
        ("gs://bucket/ckpt?X-Goog-Signature=abc#frag", "gs://bucket/ckpt?X-Goog-Signature=REDACTED"),
        ("https://token@host/path@with-at", "https://REDACTED@host/path@with-at"),
        ("/local/dir/with@sign", "/local/dir/with@sign"),
    ],
)
def test_redaction(raw: object, expected: str) -> None:
    assert redact_checkpoint_id(raw) == expected  # type: ignore[arg-type]


def test_signed_urls_that_differ_only_in_secrets_redact_alike() -> None:
    rank0 = "https://h/ckpt?X-Amz-Date=20261122T000000Z&X-Amz-Signature=aaaa"
    rank1 = "https://h/ckpt?X-Amz-Date=20261122T000001Z&X-Amz-Signature=bbbb"
    assert redact_checkpoint_id(rank0) == redact_checkpoint_id(rank1)


def test_very_long_ids_are_cut() -> None:
    assert len(redact_checkpoint_id("/x" * 2000)) == MAX_LENGTH
