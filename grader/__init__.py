"""Grades a learner's notebook code by plugging it into the reference engine."""
