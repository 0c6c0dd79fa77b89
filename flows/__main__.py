"""`python -m flows` runs the retrain flow once (same options as `python -m flows.retrain`)."""

import sys

from flows.retrain import main

sys.exit(main())
