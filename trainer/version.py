"""rlite's version, in a module that imports nothing: the package hands it on as ``rlite.__version__``, and
the modules that record it (the plugin manager's origins, a run's provenance) read it here."""

__version__ = "0.1.0"
