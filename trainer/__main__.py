"""``python -m rlite ...``, the ``rlite`` console script (``rlite.__main__:main``), and what ``torchrun -m rlite
train ...`` runs."""

from rlite import entry


def main() -> int:
    """Record a SIGTERM first (:mod:`rlite.entry`), then import and run the command."""
    entry.install()
    from rlite.tools.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
