"""rlite's commands and their tools: the ``rlite`` CLI, ``rlite audit``, the combinations matrix, ``rlite chat``
and ``rlite generate``, and the generator of the docs' samples."""
