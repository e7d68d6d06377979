"""``python -m patches.ledger --toml RECIPE.toml --budget-gib 22.06``: will this run fit the card?

The recipe's own ledger does the counting (``cosmos_framework_ext.recipe.ledger``, resolved by import string
when this command runs, so ``patches`` imports no recipe at module level); the table format lives in
:mod:`patches.core.ledger`. It builds the model on the meta device (nothing is allocated), itemises
every component's predicted GPU and host bytes, totals them against the budget and says whether the run
fits; for a run that does not fit it names the lever (or the cap) that closes the gap. The launcher's
``DRYRUN=1`` prints the same, and every run prints it at start.

Exit status: 0 fits, 1 does not fit, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import sys

from .guard import resolve

RECIPE_LEDGER_CLI = "cosmos_framework_ext.recipe.ledger:main"
"""Import string of the command line that sizes a recipe TOML."""


def main(argv: list[str] | None = None) -> int:
    return resolve(RECIPE_LEDGER_CLI)(argv)


if __name__ == "__main__":
    sys.exit(main())
