class R2RError(Exception):
    """An error the user can fix; the CLI prints its message on one line and exits non-zero."""
