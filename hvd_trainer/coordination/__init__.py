"""Coordination: how the ranks agree on what runs next (the scheduler, the agreement and
its messages, stall warnings, handles, automatic names, process sets)."""
