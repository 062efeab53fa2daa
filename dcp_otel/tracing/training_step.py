"""The training step a checkpoint is of: said by the training loop, or read from the checkpoint id.

Every operation span carries it as ``dcp.training.step``. The training loop
says it with :func:`set_training_step` (or the :func:`training_step` context
manager); otherwise it is read from the last path component of the checkpoint
id with a pattern (``DCP_OTEL_STEP_PATTERN``, or ``step_pattern=`` of
``instrument()``). The default pattern reads the common layouts:

==========================  ======================================
checkpoint id               step
==========================  ======================================
``/ckpt/step-1000``         1000 (torchtitan)
``/ckpt/step_1000``         1000
``/ckpt/iter_0001000``      1000 (Megatron-LM)
``/ckpt/global_step1000``   1000 (DeepSpeed)
``/out/checkpoint-500``     500 (Hugging Face Trainer)
``epoch=0-step=100.ckpt``   100 (Lightning)
``s3://b/run/1000/``        1000 (a number alone)
``/ckpt/latest``            none
==========================  ======================================

A pattern of your own is a regular expression searched in that component; its
group ``step`` (or its first group) is the number. ``off`` reads none.

Usage::

    dcp_otel.set_training_step(1000)                 # operations from now on are of step 1000
    with dcp_otel.training_step(2000):
        dcp.save(state_dict, checkpoint_id="/ckpt/latest")   # dcp.training.step = 2000
    step_from_id("/ckpt/iter_0001000", DEFAULT_STEP_PATTERN)   # -> 1000
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from dcp_otel.live.signal_exceptions import reraise_if_signalled

#: The layouts of the table above: a keyword and a number ending the component (an extension may follow),
#: or a component that is a number alone.
DEFAULT_STEP_PATTERN: Final = (
    r"(?:(?:global_step|step|iteration|iter|checkpoint|ckpt)[-_=]?|^)0*(?P<step>\d+)(?:\.[A-Za-z]\w*)?$"
)
#: The pattern value that reads no step from checkpoint ids.
OFF: Final = "off"

_lock = threading.Lock()
_explicit: int | None = None


def _checked(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a training step is a whole number of at least 0, got {step!r}")
    return step


def set_training_step(step: int | None) -> None:
    """Say the training step of the checkpoints from now on (``None``: read it from checkpoint ids again).

    Raises:
        ValueError: not a whole number of at least 0.
    """
    global _explicit
    value = None if step is None else _checked(step)
    with _lock:
        _explicit = value


@contextmanager
def training_step(step: int) -> Iterator[None]:
    """The checkpoints inside are of ``step``; the step said before comes back after."""
    global _explicit
    value = _checked(step)
    with _lock:
        before, _explicit = _explicit, value
    try:
        yield
    finally:
        with _lock:
            _explicit = before


def explicit_step() -> int | None:
    """The step the training loop said, if it said one."""
    return _explicit


@functools.lru_cache(maxsize=8)
def compiled(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` compiled (``None`` for ``off``).

    Raises:
        ValueError: not a regular expression, or one without a group for the number.
    """
    if pattern.strip().lower() == OFF:
        return None
    try:
        found = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"step pattern {pattern!r} is not a regular expression: {exc}") from None
    if found.groups < 1:
        raise ValueError(f"step pattern {pattern!r} needs a group for the number, e.g. step-(\\d+)")
    return found


def step_from_id(checkpoint_id: str | None, pattern: str) -> int | None:
    """The step in the last path component of ``checkpoint_id``, by ``pattern``; ``None`` where it says none."""
    regex = compiled(pattern)
    if regex is None or not checkpoint_id:
        return None
    component = checkpoint_id.rstrip("/").rpartition("/")[2]
    match = regex.search(component)
    if match is None:
        return None
    text = match.group("step") if "step" in regex.groupindex else match.group(1)
    return int(text) if text is not None and text.isdigit() else None


#: Where a checkpointing library keeps the step its caller said (``torch_checkpointing``'s logging context): read for
#: that library's operations, after the step said to dcp-otel, before the checkpoint id. Set by
#: :mod:`dcp_otel.attach.patches`.
library_steps: list[Callable[[], object]] = []


def current_step(checkpoint_id: str | None, pattern: str, library: bool = False) -> int | None:
    """What an operation on ``checkpoint_id`` says: the training loop's step, else (``library``: an operation of a
    checkpointing library) the one its library's context says, else the id's."""
    explicit = _explicit
    if explicit is not None:
        return explicit
    for read in library_steps if library else ():
        try:
            said = read()
        except Exception as exc:  # noqa: BLE001 - a library's context that changed shape: no step from it
            reraise_if_signalled(exc)
            continue
        if type(said) is int and said >= 0:
            return said
    return step_from_id(checkpoint_id, pattern)
