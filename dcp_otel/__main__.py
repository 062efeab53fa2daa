"""``python -m dcp_otel``: the ``dcp-otel`` command."""

import sys

from dcp_otel.cli import main

sys.exit(main())
