"""A run of several traces (ranks, capture windows, the agent's step series): one verdict over their
reports (``verdict``), ranks and stragglers, the job's limiter, the run's memory leak.
"""
