"""``python -m shardplan``: the same command line as the ``shardplan`` console script."""

from .cli import entry

if __name__ == "__main__":
    entry()
