"""Stand-in for triton (about 1 GB) in the SGLang compat venv.

``sglang/srt/utils/common.py`` imports triton at module level but uses it only inside functions
that the serializer never calls, so a module with a version is enough for the import.
"""

__version__ = "3.9.0"
