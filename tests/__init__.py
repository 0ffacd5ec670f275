"""The test suite: unit/, integration/ and numerics/ tests, and their shared helpers in support/."""
