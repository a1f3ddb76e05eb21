"""The centralised TCP backend: owns one coordinator, persists it, ticks it and broadcasts its state."""
