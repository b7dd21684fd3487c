"""`python -m tardigrade_operator.cli`: the `tardigrade` command."""

from tardigrade_operator.cli import main

main()
