"""`python -m lockstep launch ...`."""

from .cli import main

raise SystemExit(main())
