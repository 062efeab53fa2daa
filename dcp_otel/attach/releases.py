"""The torch releases dcp-otel is tested with, and what it says about any other.

dcp-otel does not depend on torch (as OpenTelemetry's instrumentation packages
do not depend on the library they instrument): installing it never changes the
torch of a training image. It declares the releases it instruments
(:data:`INSTRUMENTS`, the ``instruments`` extra, which ``opentelemetry-instrument``
checks before it loads the instrumentor) and checks the release at
``instrument()``: an older one is refused there by ``BaseInstrumentor``, a
newer one than the newest tested gets one warning, and every attachment point
a release lacks is named once and skipped (:func:`dcp_otel.attach.patches.install`).

Usage::

    untested_release_warning(torch.__version__)   # None, or the one line to log
"""

from __future__ import annotations

import re
from typing import Final

#: The oldest release dcp-otel instruments (what ``instrumentation_dependencies`` says).
OLDEST: Final = (2, 11)
#: The releases the test command runs the core suites on.
TESTED: Final = ("2.11.0", "2.13.0", "2.15.0")
NEWEST_TESTED: Final = (2, 15)
INSTRUMENTS: Final = f"torch >= {OLDEST[0]}.{OLDEST[1]}"


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``2.11.0+cu130`` -> ``(2, 11)``), ``None`` if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def untested_release_warning(version: str) -> str | None:
    """The warning for a torch newer than the newest tested release (``None`` for a tested one)."""
    found = release(version)
    if found is None or found <= NEWEST_TESTED:
        return None
    return (f"dcp_otel: torch {version} is newer than the releases dcp-otel is tested with "
            f"({', '.join(TESTED)}); instrumenting what exists, and naming below anything missing")  # fmt: skip
#: The ``torch_checkpointing`` releases the tests run (an optional package: ``pip install 'dcp-otel[checkpointing]'``).
CHECKPOINTING_TESTED: Final = ("0.1.1",)
