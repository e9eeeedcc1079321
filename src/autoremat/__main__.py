"""``python -m autoremat``: the same as the ``autoremat`` command."""

import sys

from autoremat.cli.commands import main

sys.exit(main())
