"""The customer-support example: three tools, one per tier, over a fake outbox and account store.

Run it with ``undolog demo`` or ``python -m examples.support_agent``.
"""
