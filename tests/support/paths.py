"""Where the tests' files are: the tests/ folder (worker scripts under workers/) and the repository root."""
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
