"""The RNNT branch: the user's transcript, one encoder frame at a time."""
