"""A stand-in for a module a framework imports at module level but does not use on the path a
target checks (ray, httpx, tensordict, ...), put in ``sys.modules`` only when the module is
missing; every framework adapter reports which ones it stubbed."""

from __future__ import annotations

import types
from typing import Any


class Stub(types.ModuleType):
    """Anything taken from it is another stub; calling one yields a stub, so import-time
    decorators, base classes (``__mro_entries__``), annotations (``|``, ``[]``) work."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self.__name__}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return Stub(f"{self.__name__}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __or__

    def __getitem__(self, item: Any) -> Any:
        return self
