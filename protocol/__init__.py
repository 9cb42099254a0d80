"""The contract between the actors: wire messages, codec, addresses, config, client library."""
