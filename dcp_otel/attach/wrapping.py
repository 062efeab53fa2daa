"""How one attachment point is put in place: replaced by a plain function, or wrapped by wrapt.

A hot patch (called for every collective of every save on the training thread)
is a *replacer*: given the original, the function that takes its place, one
frame per call (:func:`replace_plainly`); where the original is not a plain
function (a static method, a builtin), the replacer goes through wrapt
(:func:`_through_wrapt`). Every other patch is a wrapper in wrapt's signature,
behind a switch: once :meth:`dcp_otel.attach.patches.Installed.remove` turns it
off, a wrapper that another tool's wrapper covers (and so stays in place) only
passes calls through.

Usage::

    placed = wrap(owner, "method", wrapper, hot=False, switch=installed.switch)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import FunctionType
from typing import Any

import wrapt

#: A hot patch's: given the original function, the function that takes its place.
Replacer = Callable[[Callable[..., Any]], Callable[..., Any]]


def attribute(owner: Any, attr: str) -> Any:
    """What stands at ``owner.attr``: on a class, only what the class defines itself (an inherited method, or
    the bound form of a static method, is not the object to wrap or to put back); ``None`` where nothing is."""
    return vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


def replace_plainly(owner: Any, attr: str, replacer: Replacer) -> bool:
    """Put ``replacer(original)`` in the place of a plain function of a module or a plain method of a class.

    The replacement carries the original's name, docstring and ``__wrapped__``. Anything else (a static
    or class method, a builtin, a callable object): ``False``, and nothing changed; :func:`wrap` then
    hands the replacer to ``wrapt``.
    """
    original = attribute(owner, attr)
    if type(original) is not FunctionType:
        return False
    setattr(owner, attr, functools.wraps(original)(replacer(original)))
    return True


def _through_wrapt(replacer: Replacer, method: bool) -> Callable[..., Any]:
    """A replacer as a wrapper in wrapt's signature (a replacement made per call: only where
    :func:`replace_plainly` cannot replace). ``method``: the replacement takes the instance first (wrapt's
    ``instance``: ``None`` for a static method)."""
    if method:
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return replacer(lambda _self, *a, **k: wrapped(*a, **k))(instance, *args, **kwargs)
    else:
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return replacer(wrapped)(*args, **kwargs)
    return wrapper


def wrap(owner: Any, attr: str, wrapper: Callable[..., Any], hot: bool, switch: list[bool] | None = None) -> Any:
    """Wrap ``owner.attr``: ``hot``, ``wrapper`` is a replacer (:class:`Patch`), put in the original's place
    when that is a plain function; otherwise, or not hot, ``wrapper`` in wrapt's signature, by wrapt.

    ``switch``: a non-hot wrapper passes calls through once ``switch[0]`` is false. Returns what now
    stands at ``owner.attr``.
    """
    if not hot:
        wrapt.wrap_function_wrapper(owner, attr, wrapper if switch is None else _switched(wrapper, switch))
    elif not replace_plainly(owner, attr, wrapper):
        wrapt.wrap_function_wrapper(owner, attr, _through_wrapt(wrapper, isinstance(owner, type)))
    return attribute(owner, attr)


def _switched(wrapper: Callable[..., Any], switch: list[bool]) -> Callable[..., Any]:
    """``wrapper``, or a plain pass-through once ``switch[0]`` is off (a wrapper left under another tool's)."""
    def switched(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if switch[0]:
            return wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    return switched
