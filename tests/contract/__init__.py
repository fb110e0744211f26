"""One contract for every storage backend: each backend brings fixtures, the tests are shared."""
