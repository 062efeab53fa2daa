"""The report's times add up: the invariants every checkpoint row must satisfy."""

from __future__ import annotations

from dcp_otel.report.model import Checkpoint

EPS = 1e-6


def assert_times_add_up(checkpoints: list[Checkpoint]) -> None:
    """busy + waiting = total on every row; an async save's caller and upload sides each nest."""
    assert checkpoints
    for ckpt in checkpoints:
        for r in ckpt.ranks:
            where = (ckpt.operation, ckpt.checkpoint_id, r.rank)
            assert 0 <= r.busy_s <= r.duration_s + EPS, where
            assert abs(r.busy_s + r.wait_s - r.duration_s) < EPS, where
            if ckpt.operation == "async_save":
                assert r.staging_s <= r.busy_s + EPS, where  # staging is the caller's work
                assert r.io_s <= r.upload_busy_s + EPS, where  # writing is part of the upload's steps
                assert r.upload_busy_s <= r.upload_s + EPS, where  # ... which are part of the upload
            else:
                assert r.upload_busy_s == 0 and r.staging_s == 0, where
                assert r.io_s <= r.busy_s + EPS, where
