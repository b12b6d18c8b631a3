"""What several commands share: checked sampling settings, progress bars, one model alone as an engine."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from roads_to_rome.cli.options import console


def progress_bar(*columns: ProgressColumn) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), *columns,
                    TimeElapsedColumn(), console=console)


def sampling(max_new_tokens, temperature, top_p, top_k, stop, seed, **settings):
    """A command's sampling options as `SamplingParams` (`settings`: its other fields, by name), checked."""
    from roads_to_rome.core.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop=tuple(stop or ()), seed=seed, **settings)
    params.validate()  # before the slow model load
    return params


class RateColumn(ProgressColumn):
    def render(self, task):
        return Text(f"{task.speed:.2f} it/s" if task.speed else "– it/s", style="progress.data.speed")


def load_alone(spec: str | None, role: str, device: str, dtype: str, backend: str):
    """One model alone as an engine (`models.load_alone`)."""
    from roads_to_rome.models import load_alone

    return load_alone(spec, role, device, dtype, backend)
