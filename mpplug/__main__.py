"""`python -m mpplug`: the same command line as the `mpplug` script.

See `mpplug.cli` for the commands and exit codes.
"""

import sys

from mpplug.cli import main

if __name__ == "__main__":
    sys.exit(main())
