"""Intermediate representations shared by the stages: regions, views, the OpGraph."""
