"""``python -m serve``: the OpenAI-compatible server (see ``serve.cli``)."""

import sys

from serve.cli import main

sys.exit(main())
