"""A pass-through wrapper that records what a wrapped function returned.

It lives in its own file so that error reports can skip its frame: an exception raised by the
call (a caller passing an argument the function does not take, say) is reported at the caller,
where the mistake is, not here.
"""

from __future__ import annotations

import inspect
from typing import Any


class Recorder:
    """Calls ``fn`` with the caller's own arguments, untouched, and keeps each result."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.results: list[Any] = []
        self.__wrapped__ = fn
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.fn(*args, **kwargs)
        self.results.append(result)
        return result
