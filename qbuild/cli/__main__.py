"""`python -m qbuild.cli`: the same program as the `qbuild` script."""

from qbuild.cli import main

if __name__ == "__main__":
    main()
