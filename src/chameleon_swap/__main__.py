"""``python -m chameleon_swap``: the same entry point as the ``chameleon-swap`` script."""
import sys

from chameleon_swap.cli import main

if __name__ == "__main__":
    sys.exit(main())
