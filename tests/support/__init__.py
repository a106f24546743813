"""What the tests share: fixtures, fakes, servers and checks, kept apart from the tests.

``tests/conftest.py`` loads the fixture modules as pytest plugins (its ``pytest_plugins``);
everything else is imported by name (``from support.polling import wait_for``). A few
modules are also programs: ``reference_node`` is run by path, and the benchmarks import
``s3_fixtures``, ``egress_net``, ``solari_gateway`` and ``api_requests``. docs/testing.md
lists them all.
"""
