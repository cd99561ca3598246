"""``python -m collab_kit.cli``: the same as the ``collab-kit`` console script."""

import sys

from collab_kit.cli.app import main

sys.exit(main())
