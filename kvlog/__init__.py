"""The Kafka log between the bridge and the consumers: its record contract and client plumbing."""
