"""``python -m icqs_fast.cli``."""

import sys

from icqs_fast.cli import main

sys.exit(main())
