"""``python -m service.api``: the REST API process (``service.api.app``)."""

import sys

from service.api.app import main

sys.exit(main())
