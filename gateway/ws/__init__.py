"""The Realtime session protocol: a sans-I/O session core, typed events, the frame codec and the asyncio adapter around them."""
