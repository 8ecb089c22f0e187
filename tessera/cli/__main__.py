"""``python -m tessera.cli``: the ``tessera`` command."""

import sys

from . import main

sys.exit(main())
