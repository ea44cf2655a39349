"""``kvtier sim``: replay request traces through simulated fleets of real kvtier caches (see ``cli``)."""
