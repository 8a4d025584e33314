"""``python -m service.cli`` is ``tlab``."""

import sys

from service.cli import main

sys.exit(main())
