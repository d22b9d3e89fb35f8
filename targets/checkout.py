"""A framework target loaded from a source checkout: what every such adapter shares, written once.

A framework adapter declares its :class:`~shardcheck.targets.source.Framework` (where a checkout
is, which packages are its own, what may be stubbed), subclasses :class:`CheckoutTarget` with
what is its own (the functions it calls, its era table, its definitions) and registers a
:class:`CheckoutFactory`. This module does the rest: the source found and validated, the commit,
the framework's modules imported from the checkout without their package ``__init__``s where it
says so, third-party modules stubbed only where missing and allowed, torch.compile made eager, no
bytecode written into the user's checkout, and every one of those undone by ``release()``; the
``describe()`` fields every report carries; the variants and options ``shardcheck targets``
lists.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, ClassVar

from shardcheck.errors import BadInput
from shardcheck.targets.base import TargetBase
from shardcheck.targets.source import Framework
from shardcheck.targets.stub import Stub


class _EmptyPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The framework's packages as empty packages over the checkout's folders (their
    ``__init__.py`` is not run); its modules are the checkout's files, loaded as they are."""

    def __init__(self, framework: Framework, root: Path) -> None:
        self.framework, self.root = framework, root
        self.shells: list[str] = []
        # "skip_above": only these packages are empty; the others are the checkout's, as they are
        self.only: set[str] | None = set() if framework.package_inits == "skip_above" else None

    def hold(self, module: str) -> None:
        """Make the packages holding ``module`` empty ones ("skip_above")."""
        if self.only is not None:
            self.only.update(".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1))

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if not self.framework.owns(name) or (self.only is not None and name not in self.only):
            return None
        where = self.root.joinpath(*name.split("."))
        if where.is_dir():
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = [str(where)]
            return spec
        if where.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, where.with_suffix(".py"))
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ not in self.shells:
            self.shells.append(module.__name__)


class Checkout:
    """One checkout's modules imported into this process, and all that took, undone by
    :meth:`release` (the rank may move on to another target, or another commit of the same)."""

    def __init__(self, framework: Framework, src: Path) -> None:
        self.framework, self.src = framework, src
        self.stubs: list[str] = []
        self._undo: list[Callable[[], Any]] = []
        self._finder: _EmptyPackages | None = None
        self._prepared = False

    @property
    def package_inits_not_run(self) -> list[str]:
        return list(self._finder.shells) if self._finder is not None else []

    def undo_later(self, undo: Callable[[], Any]) -> None:
        """Have :meth:`release` run ``undo`` (last in, first out): for a process-wide setting an
        adapter makes itself."""
        self._undo.append(undo)

    def _prepare(self) -> None:
        fw, src = self.framework, self.src
        self._prepared = True
        saved = {m: sys.modules.pop(m) for m in [m for m in sys.modules if fw.owns(m)]}
        before = set(sys.modules)

        def restore() -> None:
            for m in [m for m in sys.modules if m not in before and (fw.owns(m) or self._stubbable(m))]:
                del sys.modules[m]
            sys.modules.update(saved)

        self._undo.append(restore)
        if fw.package_inits == "run":
            if str(src) not in sys.path:
                sys.path.insert(0, str(src))
                self._undo.append(lambda: sys.path.remove(str(src)) if str(src) in sys.path else None)
        else:
            finder = self._finder = _EmptyPackages(fw, src)
            sys.meta_path.insert(0, finder)
            self._undo.append(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)
        wrote_bytecode = sys.dont_write_bytecode
        self._undo.append(lambda: setattr(sys, "dont_write_bytecode", wrote_bytecode))
        sys.dont_write_bytecode = True  # never write into the user's checkout
        if fw.eager:
            if "TORCHDYNAMO_DISABLE" not in os.environ:
                os.environ["TORCHDYNAMO_DISABLE"] = "1"
                self._undo.append(lambda: os.environ.pop("TORCHDYNAMO_DISABLE", None))
            import torch._dynamo

            was_disabled = torch._dynamo.config.disable
            self._undo.append(lambda: setattr(torch._dynamo.config, "disable", was_disabled))
            torch._dynamo.config.disable = True

    def _stubbable(self, name: str) -> str | None:
        return next((s for s in self.framework.stubbable if name == s or name.startswith(s + ".")), None)

    def import_module(self, name: str) -> types.ModuleType:
        """One of the framework's modules from the checkout; a missing module it imports is
        stubbed where the framework allows it, else BadInput (one line), as is a broken commit."""
        if not self._prepared:
            self._prepare()
        if name in sys.modules:
            return sys.modules[name]
        if self._finder is not None:
            self._finder.hold(name)
        title, src = self.framework.title, self.src
        for _ in range(4 * len(self.framework.stubbable) + 1):
            try:
                return importlib.import_module(name)
            except ModuleNotFoundError as exc:
                missing = exc.name or ""
                if not self._stubbable(missing) or missing in self.stubs:
                    raise BadInput(f"{title} at {src} cannot be imported ({name}): {exc}") from None
                for m in [m for m in sys.modules if self.framework.owns(m)]:
                    del sys.modules[m]  # retried whole: a half-imported module must not stay
                parts = missing.split(".")
                for i in range(1, len(parts) + 1):
                    sys.modules.setdefault(".".join(parts[:i]), Stub(".".join(parts[:i])))
                self.stubs.append(missing)
            except BadInput:
                raise
            except Exception as exc:  # a broken commit: reported as such (bisect skips it)
                raise BadInput(f"{title} at {src} cannot be imported ({name}): {type(exc).__name__}: {exc}") from None
        raise BadInput(f"{title} at {src} cannot be imported ({name})")

    def release(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.stubs = []
        self._finder = None
        self._prepared = False


def era_facts(era: Any) -> dict[str, Any]:
    """An adapter's era as reports show it: its dataclass's fields, nested ones too
    (``dataclasses.asdict``: the JSON of the dicts eras were before); {} for a target with none."""
    return dataclasses.asdict(era) if era is not None else {}


class CheckoutTarget(TargetBase):
    """The base of a framework target loaded from a checkout. A subclass sets :attr:`framework`
    and :attr:`name`, reads its era from ``self.src`` and calls the framework's functions from
    :meth:`import_module`; it drops what it built from them in :meth:`forget` and adds its own
    report fields in :meth:`description`."""

    framework: ClassVar[Framework]
    name: str
    era: Any  # what the checkout offers, read from its source: the adapter's own frozen dataclass

    def __init__(self, src: str | None = None) -> None:
        self.src = self.framework.source(src)
        self.commit = self.framework.commit(self.src)
        self.checkout = Checkout(self.framework, self.src)

    @property
    def stubs(self) -> list[str]:
        return self.checkout.stubs

    def short(self) -> str:
        """The commit as messages name it (the folder's name where there is no git)."""
        return self.commit[:10] if self.commit else self.src.name

    def import_module(self, name: str) -> types.ModuleType:
        return self.checkout.import_module(name)

    def release(self) -> None:
        """Undo what importing the framework set in this process (the rank moves to another target)."""
        self.checkout.release()
        self.forget()

    def forget(self) -> None:
        """Drop what was built from the framework's modules (they are imported again on next use)."""

    def describe(self) -> dict[str, Any]:
        version = self.commit[:12] if self.commit else f"checkout {self.src} (no git commit)"
        out = {"name": self.name, "version": version, "commit": self.commit, "src": str(self.src),
               "era": era_facts(getattr(self, "era", None)), "stubbed_modules": list(self.stubs)}
        if self.framework.package_inits != "run":
            out["package_inits_not_run"] = self.checkout.package_inits_not_run
        out.update(self.description())
        return out

    def description(self) -> dict[str, Any]:
        """The target's own report fields, besides those every checkout target has."""
        return {}


def refuse_loss_variant(name: str, variant: str | None, config: Any, loss_options: tuple[str, ...]) -> None:
    """For an adapter whose ``loss`` variant lives in a module that builds on it (the registered
    factory in :mod:`shardcheck.targets.frameworks` builds that one): refuse ``loss`` and the
    loss's options, one line each."""
    if variant == "loss":
        raise BadInput(f"{name}:loss is built by the registered target (shardcheck.targets.frameworks: "
                       f"--target {name}:loss)")
    given = [k for k in loss_options if config.get(k) is not None]
    if given:
        raise BadInput(f"option {given[0]} is {name}:loss's (the training step's loss)")


class CheckoutFactory:
    """A framework target's registered factory: ``factory(variant, config=...)`` builds the
    target; ``options`` and ``variants`` are what ``shardcheck targets`` lists and what a command
    line may ask for (anything else is refused, one line)."""

    def __init__(self, framework: Framework, build: Callable[[str | None, Any], Any], *, doc: str,
                 options: dict[str, str] | None = None, variants: dict[str, str] | None = None) -> None:
        self.framework = framework
        self._build = build
        self.__doc__ = doc
        self.options = dict(options or {})
        self.variants = dict(variants or {})

    def __call__(self, variant: str | None = None, config: Any = None) -> Any:
        from shardcheck.targets.base import TargetConfig

        if variant is not None and variant not in self.variants:
            raise BadInput(f"target {self.framework.name!r} has no variant {variant!r} "
                           f"(known: {', '.join(sorted(self.variants)) or 'none'})")
        return self._build(variant, config if config is not None else TargetConfig())


class PreparedInputsPath(abc.ABC):
    """A framework's data path whose one call gives what its model is handed on this rank
    (:meth:`prepare`: a dict with ``input_ids``, and ``position_ids`` where it hands them): the
    tokens and the model inputs the harness asks of one rollout come from a single call."""

    def __init__(self) -> None:
        self._last: tuple[Any, dict[str, Any]] | None = None

    @abc.abstractmethod
    def prepare(self, rollout: Any) -> dict[str, Any]:
        """The framework's own code on ``rollout``: what this rank's model is handed."""

    def _prepared(self, rollout: Any) -> dict[str, Any]:
        if self._last is None or self._last[0] is not rollout:
            self._last = (rollout, self.prepare(rollout))
        return self._last[1]

    def local_tokens(self, rollout: Any) -> Any:
        return self._prepared(rollout)["input_ids"]

    def model_inputs(self, rollout: Any) -> dict[str, Any]:
        """The position ids the framework hands the model, one per local row (its padding rows are
        padding to the harness, whatever they hold)."""
        position_ids = self._prepared(rollout).get("position_ids")
        return {} if position_ids is None else {"position_ids": position_ids.reshape(-1)}
