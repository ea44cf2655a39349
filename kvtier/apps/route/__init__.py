"""Routing requests to replicas by what they cache and how loaded they are (see ``scoring``)."""
