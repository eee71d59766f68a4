"""`python -m esftctl ...`: the `esftctl` command, from any Python that has the package."""

from esftctl.cli import main

main()
