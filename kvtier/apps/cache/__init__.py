"""``kvtier cache``: the admin API of a kvtier serve or route from the command line."""
