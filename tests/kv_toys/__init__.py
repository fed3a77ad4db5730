"""Toy KV plugins that show the KV seams hold (test only): a host tier and a swap mode."""
