"""``python -m rsmem.cli``: the ``rsmem`` command."""

import sys

from rsmem.cli import main

sys.exit(main())
