"""The beat tests run on the same real clusters as the task tests."""

from tests.tasks.conftest import make_cluster  # noqa: F401  (a fixture, used by name)
