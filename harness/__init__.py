"""Running a real graph from Python: shared by tests and benchmarks."""
