"""Helpers shared by tests in several packages.

One import style everywhere: test modules import helpers absolutely from the repository root
(`from tests.support.fake_model import FakeModel`, `from tests.core.core_fakes import Driver`);
they never import conftest modules or other test modules, and never touch `sys.path`.
"""
