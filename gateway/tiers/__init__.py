"""The engine tiers this gateway serves: building them from the config, keeping them alive."""
