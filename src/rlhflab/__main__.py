"""`python -m rlhflab ...` (what `torchrun -m rlhflab train CONFIG` runs on every rank)."""

import sys

from rlhflab.cli import main

sys.exit(main())
