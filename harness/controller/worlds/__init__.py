"""The worlds a command runs on (spawned, joined, simulated), and what one may ask of this machine."""
