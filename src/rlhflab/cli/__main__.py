"""`python -m rlhflab.cli ...`, as `python -m rlhflab ...`."""

import sys

from rlhflab.cli import main

sys.exit(main())
