"""qbuild: manifest-driven builds of compiled model artifacts."""

__version__ = "0.1.0"
