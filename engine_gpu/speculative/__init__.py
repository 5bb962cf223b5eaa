"""Speculative decoding: drafters, verification, the self-disable switch."""
