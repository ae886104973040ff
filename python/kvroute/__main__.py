"""``python -m kvroute``: the command line."""

from kvroute.cli import main

main()
