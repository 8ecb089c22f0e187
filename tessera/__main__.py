"""``python -m tessera``: the ``tessera`` command (see :mod:`tessera.cli`)."""

import sys

from .cli import main

sys.exit(main())
