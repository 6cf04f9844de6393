"""``python -m specdec``: the command line."""

import sys

from specdec.commands.cli import main

sys.exit(main())
