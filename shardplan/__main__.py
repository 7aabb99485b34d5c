"""``python -m shardplan``: the same command line as the ``shardplan`` console script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
