"""Credentials in checkpoint ids never reach telemetry."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from dcp_otel.redact import MAX_LENGTH, redact_checkpoint_id, redact_text


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
        # an AWS secret key holds "/": the user-info runs to the last "@", not to the first "/"
        ("s3://AKIAXXX:se/cr+et@bucket/ckpt", "s3://REDACTED@bucket/ckpt"),
        ("gs://bucket/team@example.com/ckpt", "gs://bucket/team@example.com/ckpt"),  # no "user:": a path
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


def test_urls_and_secret_parameters_in_free_text_are_redacted() -> None:
    text = (
        "PUT https://b.s3.amazonaws.com/ckpt/0.distcp?X-Amz-Credential=AKIASECRET&X-Amz-Signature=SIGSECRET "
        "failed (403); retried 's3://AKIASECRET:se/cr+et@bucket/ckpt' with token=TOKSECRET, "
        "X-Amz-Security-Token=STSSECRET; size=4096"
    )
    redacted = redact_text(text)
    assert not [s for s in ("AKIASECRET", "SIGSECRET", "se/cr+et", "TOKSECRET", "STSSECRET") if s in redacted]
    assert "https://b.s3.amazonaws.com/ckpt/0.distcp?X-Amz-Credential=REDACTED" in redacted  # where it failed stays
    assert redacted.endswith("size=4096")  # an ordinary parameter stays
    assert redact_text("No space left on device") == "No space left on device"
