"""How a session's events and audio travel: below the dialects, knowing no protocol."""
