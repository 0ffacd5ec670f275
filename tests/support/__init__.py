"""Helpers shared by the tests (tiny models, prompts, a served process, kernel marks); no tests here."""
