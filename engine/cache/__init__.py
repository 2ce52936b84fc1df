"""The device expert cache: settings, policy (shared with the simulator), slots, uploads, warm start, trace, stats."""
