"""`python -m shadowprefill ...` is the `shadowprefill` command."""
import sys

from shadowprefill.cli import main

if __name__ == "__main__":
    sys.exit(main())
