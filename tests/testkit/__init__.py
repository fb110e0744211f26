"""The test suite's shared helpers: one package, importable from every test, conftest and
helper (pytest puts ``tests`` on ``sys.path``, ``[tool.pytest.ini_options] pythonpath``), and
from a child process started through :func:`testkit.paths.with_testkit`."""
