"""Plots for reports: matplotlib drawing into files only, never onto a display."""


def pyplot():
    """matplotlib's pyplot on its file-only backend (Agg): a report plots on a machine with no display. Imported on
    first use, so that only the commands that plot pay for matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
