class R2RError(Exception):
    """An error the user can fix; the CLI prints its message on one line and exits non-zero."""


class RemoteError(R2RError):
    """A remote model's server failed: unreachable, timed out, refused a request, or answered nonsense."""
