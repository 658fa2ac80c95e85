"""Observation: the tasks and actions a schedule records, the recorder, the schedule view, the
memory ledger.
"""
