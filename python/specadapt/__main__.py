"""``python -m specadapt`` = the ``specadapt`` command."""

import sys

from .cli import main

sys.exit(main())
