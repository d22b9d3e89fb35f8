"""What a rank runs on: its process groups, the collective trace, the lockstep's channels, the fork server."""
