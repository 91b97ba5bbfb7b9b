"""The test suite; a package so that tests import shared builders as ``tests.support``."""
