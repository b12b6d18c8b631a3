"""What several commands share: checked sampling settings, progress bars, one model alone as an engine."""

from __future__ import annotations

import dataclasses

from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from roads_to_rome.cli.options import console
from roads_to_rome.errors import R2RError


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


def output_format(json_schema: str | None, regex: str | None, choice: list[str] | None, grammar_file):
    """The structured output a command's --json-schema, --regex, --choice or --grammar-file asks for (one at most),
    or None."""
    from pathlib import Path

    from roads_to_rome.core.grammar import OutputFormat
    from roads_to_rome.errors import R2RError

    given = {"--json-schema": json_schema, "--regex": regex, "--choice": choice or None, "--grammar-file": grammar_file}
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        raise R2RError(f"give one structured output at most, not {' and '.join(named)}")
    if json_schema is not None:
        looks_inline = json_schema.lstrip().startswith(("{", "["))
        if not looks_inline and not Path(json_schema).is_file():
            raise R2RError(f"--json-schema takes a JSON schema or the path of a file holding one; {json_schema!r} is "
                           "neither")
        return OutputFormat("json", json_schema if looks_inline else Path(json_schema).read_text())
    if regex is not None:
        return OutputFormat("regex", regex)
    if choice:
        return OutputFormat("choice", list(choice))
    if grammar_file is not None:
        if not Path(grammar_file).is_file():
            raise R2RError(f"--grammar-file: no file at {grammar_file}")
        return OutputFormat("grammar", Path(grammar_file).read_text())
    return None


class RateColumn(ProgressColumn):
    def render(self, task):
        return Text(f"{task.speed:.2f} it/s" if task.speed else "– it/s", style="progress.data.speed")


def load_alone(spec: str | None, role: str, device: str, dtype: str, backend: str):
    """One model alone as an engine (`models.load_alone`)."""
    from roads_to_rome.models import load_alone

    return load_alone(spec, role, device, dtype, backend)


def engine_config(options: dict, **given):
    """The engine a command's options ask for (`locals()` of generate, chat and serve, which take the same ones):
    every `EngineConfig` field the command has an option of that name for, the policy from `--router`, and `given`
    (what the command works out itself) over them."""
    from roads_to_rome.models import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"policy"}
    router = options.get("router")
    chosen = {name: value for name, value in options.items() if name in names}
    return EngineConfig(**{**chosen, **given}, policy=router.value if router else None)


def whole_numbers(text: str, option: str) -> list[int]:
    """A comma-separated list of whole numbers >= 1 (empty text: none)."""
    try:
        values = [int(k) for k in text.split(",")] if text.strip() else []
    except ValueError:
        raise R2RError(f"{option} takes comma-separated whole numbers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise R2RError(f"every {option} value must be at least 1")
    return values


def show_machine(where: str, result: dict) -> None:
    """The machine, and what ran each model on it (llama.cpp's kernels, torch's CPU capability or the GPU)."""
    console.print(f"measured on {where}")
    for role, ran_with in result.get("kernels", {}).items():
        console.print(f"  {role}: {ran_with}", markup=False, highlight=False)
