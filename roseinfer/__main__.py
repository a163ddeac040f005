"""`python -m roseinfer serve ...`: see roseinfer/entrypoints/cli.py."""

from roseinfer.entrypoints.cli import main

main()
