"""``python -m jaxllm.serve``: the OpenAI-compatible server (see ``serve.cli``)."""

import sys

from jaxllm.serve.cli import main

sys.exit(main())
