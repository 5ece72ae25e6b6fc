"""Engine adapter: torch tensors <-> snapstore through a bounded staging buffer."""
