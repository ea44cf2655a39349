from tests.apps.serve.conftest import tiny_model_dir  # noqa: F401  (the tiny model fixture)
