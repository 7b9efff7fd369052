"""``python -m elastic_trainer ...`` is the ``elastic-trainer`` command; jobs submitted with a
working directory can run it without the console script being installed."""

import sys

from .cli import main

sys.exit(main())
