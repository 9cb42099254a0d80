"""The fuzz + soak job (`python -m benchmarks.fuzz`): no input from any client may take the
server down."""
