"""The conformance suite against a real vLLM (conftest.py says how to run it).

A package, so that its modules are `conformance.*` (tests/ is on sys.path, as pytest puts it
there for tests/conftest.py): its conftest is then not a second top-level `conftest` beside
tests/conftest.py, which lets one mypy run check tests/ and its subfolders together
(`mypy tests benchmarks` in .ci/run).
"""
