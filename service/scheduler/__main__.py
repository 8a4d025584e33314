"""``python -m service.scheduler``: the scheduler process (``service.scheduler.tick``)."""

import sys

from service.scheduler.tick import main

sys.exit(main())
