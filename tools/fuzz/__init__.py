"""The fuzz + soak job (`python -m tools.fuzz`): no input from any client may take the
server down."""
