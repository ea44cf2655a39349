from tests.server.conftest import tiny_model_dir  # noqa: F401  (the tiny model fixture)
