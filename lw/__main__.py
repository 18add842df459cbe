"""`python -m lw` runs the same CLI as the `lw` console script."""

import sys

from lw.cli import main

sys.exit(main())
