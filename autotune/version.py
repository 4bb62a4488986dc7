"""autotune's version, in a module of its own: the config records it, and importing it loads
nothing else."""

__all__ = ["__version__"]

__version__ = "0.1.0"
