"""samestep's version, in a module of its own so that the files it writes can name it without importing
the package (which imports them)."""

__version__ = "0.1.0"
