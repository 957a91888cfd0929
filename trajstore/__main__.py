"""`python -m trajstore ...` is the same as `trajstore ...`."""

import sys

from trajstore.cli import main

sys.exit(main())
