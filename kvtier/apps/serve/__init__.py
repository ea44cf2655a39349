"""``kvtier serve``: an OpenAI-compatible HTTP server over a transformers model with tiered prefix caching.

``backend`` loads the model and cache, ``engine`` runs generations one at a time behind a bounded queue,
``protocol`` validates request bodies, ``app`` holds the routes, ``cli`` the command.
"""
