"""Engine integrations: the only modules that import an inference engine."""
