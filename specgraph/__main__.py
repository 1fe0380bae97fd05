"""`python -m specgraph ...` (as torchrun starts it): the command line."""

import sys

from specgraph.cli import main

sys.exit(main())
