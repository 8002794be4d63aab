"""Rank 1 exits with code 3, rank 0 with 0."""

import os
import sys

sys.exit(3 if os.environ["LOCKSTEP_PROCESS_ID"] == "1" else 0)
