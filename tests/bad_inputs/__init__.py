"""Bad inputs: every way a user can hand shardplan something unusable, one row each (see cases.py)."""
