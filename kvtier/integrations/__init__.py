"""Engine integrations: the only code in kvtier that imports an inference engine."""
