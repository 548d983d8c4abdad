"""Analyzers: pure functions of one parsed trace and its steps, each returning typed stats (breakdown,
communication, inputs, memory, ops, precision, sync, transfers, workload, ...). They import ``model`` and
``parsing`` only.
"""
