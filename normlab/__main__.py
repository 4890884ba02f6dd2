"""``python -m normlab``: the command-line interface (see :mod:`normlab.cli`)."""

from __future__ import annotations

from normlab.cli import main

raise SystemExit(main())
