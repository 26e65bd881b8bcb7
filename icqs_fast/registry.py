"""One small lazy registry: a name -> a zero-argument loader whose body is a real import.

    STRATEGIES: Registry[type] = Registry("job kind")

    @STRATEGIES.add("score")
    def _score() -> type:
        from icqs_fast.jobs.score import ScoreStrategy
        return ScoreStrategy

    STRATEGIES.get("score")  # imports jobs.score (once: Python keeps the module)

Why a loader and not a ``"module:Name"`` string: the import stays lazy (``--help`` imports no
command's module, a local job never imports Ray), while a reader, an IDE or a static walk
follows the ``from ... import`` to the code it names. Commands, job kinds, executors and
backends are looked up here. Standard library only, so every layer may keep one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> loaders, in the order added; :meth:`get` calls the loader each time (its import
    is Python's, done once), so what it returns is the module's name at that moment (a test's
    monkeypatch reaches it). ``what`` names an entry in the error of an unknown name
    ("unknown job kind 'x'; one of score, pairs, features")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.loaders: dict[str, Callable[[], T]] = {}
        self.about: dict[str, str] = {}  # a line on each entry (a command's help)

    def add(self, name: str, about: str = "") -> Callable[[Callable[[], T]], Callable[[], T]]:
        """A decorator registering its function as the loader of ``name`` (each name once);
        ``about``: a line on the entry, read without loading it."""
        def register(loader: Callable[[], T]) -> Callable[[], T]:
            if name in self.loaders:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self.loaders[name] = loader
            self.about[name] = about
            return loader
        return register

    def get(self, name: str) -> T:
        """What the loader of ``name`` returns (an ImportError of the loader propagates).
        ValueError naming the registered names for an unknown one."""
        if name not in self.loaders:
            raise ValueError(f"unknown {self.what} {name!r}; one of {', '.join(self)}")
        return self.loaders[name]()

    def __contains__(self, name: object) -> bool:
        return name in self.loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self.loaders)

    def __len__(self) -> int:
        return len(self.loaders)
