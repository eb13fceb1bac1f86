"""The package version (pyproject.toml says the same), written into every checkpoint's slimlm.json."""

__version__ = "0.1.0"
