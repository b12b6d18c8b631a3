"""Progress for long work: the commands pass a rich `Progress`; a library call without one gets `QUIET`, which
takes the same calls and shows nothing, so the work itself never asks whether anybody is watching."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console


class Quiet:
    """A rich `Progress` that shows nothing: its tasks are numbers, its console prints nowhere."""

    console = Console(quiet=True)

    def add_task(self, description: str, **kwargs) -> int:
        return 0

    def advance(self, task: int, advance: float = 1) -> None:
        pass

    def update(self, task: int, **kwargs) -> None:
        pass


QUIET = Quiet()


@contextmanager
def console_progress():
    """Progress on stderr, for long work a library call starts by itself (converting a model the first time)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True)) as progress:
        yield progress
