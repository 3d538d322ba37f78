"""The runtime: the world (init, rank, size, process sets' communicators), the settings the
ranks agree on, the launcher check, install hints, safe files and the timeline."""
