"""The real cluster fixture of tests/tasks, shared with the CLI tests that need one."""

from tests.tasks.conftest import make_cluster  # noqa: F401  (the fixture, shared)
