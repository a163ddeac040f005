"""`python -m roseinfer serve ...`: see roseinfer/cli.py."""

from roseinfer.cli import main

main()
