"""The core test suite (``make test-core``). A package, so its modules and helpers are imported by qualified
name (``tests.helpers.models``), never by a bare name that ``sys.path`` order would resolve."""
