"""The version of lminvert (one place: the package, its files and results record it)."""

__version__ = "0.1.0"
