"""Plots and widgets for the course, one module per picture family.

Every function here draws data produced by the library (timelines, schedules,
ring all-reduce step records, memory estimates); none computes what it shows.
``render``-style functions return a matplotlib ``Figure`` so notebooks display
them and ``make figures`` saves the same figure to ``figures/``.
"""
