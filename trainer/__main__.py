"""``python -m rlite ...`` (also what ``torchrun -m rlite train ...`` runs)."""

from rlite.entry import main

if __name__ == "__main__":
    raise SystemExit(main())
