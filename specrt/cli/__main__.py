"""`python -m specrt.cli`."""

from specrt.cli import main

main()
