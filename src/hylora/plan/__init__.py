"""Ahead-of-time planning: the dry run, the remat planner and its sizes, parameter counts,
reading compiled programs."""
