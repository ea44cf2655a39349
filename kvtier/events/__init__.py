"""Where chunks are: the cache event stream (model.py), its ZMQ publisher and subscriber, and the wire format."""
