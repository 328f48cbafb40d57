"""`python -m multiserve ...`: the same as the `multiserve` command."""

import sys

from multiserve.cli import main

sys.exit(main())
