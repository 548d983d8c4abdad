"""The report: its typed JSON form (``contract``), what a report may show (``consistency``), its
terminal rendering (``document``) and the verdict guide (``guide``). Imports the analyzers' types only.
"""
