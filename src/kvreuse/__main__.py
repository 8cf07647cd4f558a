"""``python -m kvreuse``: the same as the ``kvreuse`` command."""

import sys

from kvreuse.cli import main

sys.exit(main())
