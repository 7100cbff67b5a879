"""smoltorrent: shared errors and defaults."""

__version__ = "0.1.0"
