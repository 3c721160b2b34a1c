"""End-to-end suites over a real TorchServe. A package, so that the servers the suites share
(conftest.py) are stopped after the last of them, not at the end of the whole test session."""
