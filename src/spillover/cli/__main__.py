"""``python -m spillover.cli``: the ``spillover`` command."""

import sys

from spillover.cli import main

sys.exit(main())
