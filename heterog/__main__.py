"""``python -m heterog`` runs the command line."""
import sys

from heterog.cli import main

sys.exit(main())
