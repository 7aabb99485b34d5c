"""Tools: what the CLI and tests run around a plan.

Contract
--------
:mod:`.sources` resolves a model spec (a preset, ``package.module:callable``,
``hf:<model_type>``, a ``config.json``) to a model; :mod:`.report` renders plans, diffs,
explanations and verification results with ``rich``; :mod:`.simulate` applies a plan on a
fake process group and counts its collectives against the estimate; :mod:`.launch` runs
functions on real gloo ranks of this machine; :mod:`.verify` compares a sharded model with
the unsharded one on those ranks (outputs, loss, every gradient).
"""
