"""`python -m kvobserve` is the `kvobserve` command."""

import sys

from kvobserve.cli import main

sys.exit(main())
