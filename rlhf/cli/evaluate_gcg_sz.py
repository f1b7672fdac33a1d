"""`python -m rlhf.cli.evaluate_gcg_sz`: the RePULSe fork's module name of the GCG evaluation, the same program as
`rlhf.cli.evaluate_gcg` (so the fork's command runs after changing only the launcher and the package)."""

from rlhf.cli.evaluate_gcg import main

if __name__ == "__main__":
    main()
